//! ductiled: the control-plane daemon. Every replica serves the API; the elected leader
//! reconciles each job's desired size against live membership and publishes generations.

pub mod access;
pub mod api;
pub mod assign;
pub mod batch;
pub mod config;
pub mod leader;
pub mod lighthouse;
pub mod observe;
pub mod reconcile;
pub mod series;
pub mod tenants;
pub mod tls;
pub mod view;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ductile_cluster::{Keys, KvBackend, Store};
use tokio_util::sync::CancellationToken;

/// Runs one replica (API + election + leader loop) until `cancel`.
pub async fn run(
    cfg: config::Config,
    backend: Arc<dyn KvBackend>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    run_with_reload(cfg, backend, cancel, None).await
}

/// [`run`], re-reading the tokens whenever `reload` yields a new configuration (SIGHUP).
pub async fn run_with_reload(
    cfg: config::Config,
    backend: Arc<dyn KvBackend>,
    cancel: CancellationToken,
    reload: Option<tokio::sync::mpsc::Receiver<anyhow::Result<config::Config>>>,
) -> anyhow::Result<()> {
    let store = Store::new(backend, Keys::new(&cfg.prefix));
    // this replica's leader key while it leads: the API's `/v1/leader`, the watchdog and the
    // lighthouse's decisions all read it
    let (leader_key_tx, leader_key_rx) = tokio::sync::watch::channel(None);
    let listener = tokio::net::TcpListener::bind(&cfg.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", cfg.listen))?;
    tracing::info!(listen = %listener.local_addr()?, id = %cfg.id, tls = cfg.tls.is_some(), "API listening");
    // one set of watches per replica, for the leader loop and the API alike
    let view = view::ClusterView::start(&store, cancel.clone());
    let tokens = Arc::new(std::sync::RwLock::new(api::Tokens {
        admin: cfg.token.clone(),
        read: cfg.read_token.clone(),
        tenants: cfg.tenants.clone(),
    }));
    if let Some(mut reload) = reload {
        let tokens = tokens.clone();
        let c = cancel.clone();
        tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    n = reload.recv() => n,
                    _ = c.cancelled() => return,
                };
                match next {
                    None => return,
                    Some(Ok(new)) => {
                        *tokens.write().unwrap_or_else(|p| p.into_inner()) = api::Tokens {
                            admin: new.token,
                            read: new.read_token,
                            tenants: new.tenants,
                        };
                        tracing::info!("configuration reloaded: the API takes the tokens its files hold now (other settings take effect at the next restart)");
                    }
                    Some(Err(e)) => {
                        tracing::error!(error = %format!("{e:#}"), "configuration reload refused: the tokens in force stay")
                    }
                }
            }
        });
    }
    let app = api::router(api::AppState {
        store: store.clone(),
        view: view.clone(),
        tokens,
        metrics_need_token: cfg.metrics_need_token,
        reads_without_token: cfg.reads_without_token,
        leader: leader_key_rx.clone(),
        id: cfg.id.clone(),
    });
    let c = cancel.clone();
    let server = match &cfg.tls {
        Some((cert, key)) => {
            let listener =
                tls::TlsListener::new(listener, tls::server_config(cert, key)?, cancel.clone())?;
            tokio::spawn(async move {
                axum::serve(listener, app)
                    .with_graceful_shutdown(async move { c.cancelled().await })
                    .await
            })
        }
        None => tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move { c.cancelled().await })
                .await
        }),
    };
    let beat = Arc::new(AtomicU64::new(0));
    let lcfg = leader::LeaderConfig {
        id: cfg.id.clone(),
        election_ttl: cfg.election_ttl,
        debounce: cfg.debounce,
        beat: beat.clone(),
        job_users: cfg.etcd.has_user(),
    };
    let lighthouse = match &cfg.torchft {
        Some(tf) => {
            let listener = tokio::net::TcpListener::bind(&tf.listen)
                .await
                .map_err(|e| {
                    anyhow::anyhow!("cannot listen on {} (--torchft-listen): {e}", tf.listen)
                })?;
            let local = listener.local_addr()?;
            tracing::info!(listen = %local, "TorchFT lighthouse listening");
            let advertise = match &tf.advertise {
                Some(a) => a.clone(),
                None if !local.ip().is_unspecified() => local.to_string(),
                None => anyhow::bail!(
                    "--torchft-listen {} names no host: give --torchft-advertise HOST:PORT (where torchft jobs' launchers reach this replica)",
                    tf.listen
                ),
            };
            let tls = match &tf.tls {
                Some((cert, key)) => {
                    // the relays speak raw bytes inside TLS: no ALPN
                    let mut c = (*tls::server_config(cert, key)?).clone();
                    c.alpn_protocols.clear();
                    Some(Arc::new(c))
                }
                None => None,
            };
            Some(tokio::spawn(lighthouse::serve(
                store.clone(),
                tf.opt.clone(),
                listener,
                advertise,
                Duration::from_secs(cfg.election_ttl.max(2) as u64),
                leader_key_rx.clone(),
                cfg.id.clone(),
                tls,
                cancel.clone(),
            )))
        }
        None => None,
    };
    let replica = tokio::spawn(leader::run_replica(
        store,
        lcfg,
        view,
        leader_key_tx,
        cancel.clone(),
    ));
    ductile_cluster::service::sd_notify(&[
        ductile_cluster::service::NotifyState::Ready,
        ductile_cluster::service::NotifyState::Status("standby"),
    ]);
    if let Some(every) = ductile_cluster::service::watchdog_interval() {
        let c = cancel.clone();
        tokio::spawn(async move {
            let mut withheld = false;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(every.min(Duration::from_secs(1))) => {}
                    _ = c.cancelled() => return,
                }
                let leading = leader_key_rx.borrow().is_some();
                let age = Duration::from_millis(
                    ductile_cluster::records::now_ms().saturating_sub(beat.load(Ordering::SeqCst)),
                );
                if watchdog_ok(leading, age, every) {
                    ductile_cluster::service::sd_notify(&[
                        ductile_cluster::service::NotifyState::Watchdog,
                    ]);
                    withheld = false;
                } else if !withheld {
                    withheld = true;
                    tracing::error!(silent_s = age.as_secs_f64(), "the leader loop has not turned: withholding the watchdog ping (systemd restarts this replica; another one takes over)");
                }
            }
        });
    }
    cancel.cancelled().await;
    ductile_cluster::service::sd_notify(&[ductile_cluster::service::NotifyState::Stopping]);
    let _ = replica.await;
    if let Some(l) = lighthouse {
        l.await??;
    }
    server.await??;
    Ok(())
}

/// Whether the watchdog may be pinged: a standby replica has nothing that can wedge but its
/// runtime (which a ping from this task already proves turning); a leader pings only while its
/// loop made a pass within `every` (half of `WatchdogSec`), so a leader loop stuck on anything
/// is restarted by systemd instead of holding leadership while doing nothing.
pub fn watchdog_ok(leading: bool, leader_loop_silent_for: Duration, every: Duration) -> bool {
    !leading || leader_loop_silent_for < every
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leader_pings_only_while_its_loop_turns() {
        let every = Duration::from_secs(15);
        assert!(watchdog_ok(false, Duration::from_secs(3600), every));
        assert!(watchdog_ok(true, Duration::from_secs(1), every));
        assert!(!watchdog_ok(true, Duration::from_secs(16), every));
    }
}

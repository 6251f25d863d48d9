//! A replica's cached view of the cluster: one watch each of `nodes/`, `drain/`, `jobs/` and
//! `live/`, shared by the leader loop and the API, so that `dctl status`, `dctl nodes` and
//! `/metrics` cost etcd nothing per request. The view knows how current it is: a ping every
//! second records when etcd last answered this replica, and the API refuses to serve a view
//! that etcd has not confirmed for [`STALE_AFTER`] (an error, never an old answer passed off
//! as the current one).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ductile_cluster::records::now_ms;
use ductile_cluster::watch::{watch_prefix, Snapshot};
use ductile_cluster::Store;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How long the view may go without etcd answering this replica before the API calls it stale.
pub const STALE_AFTER: Duration = Duration::from_secs(3);

/// How often the replica checks that etcd answers.
const PING_EVERY: Duration = Duration::from_secs(1);

#[derive(Clone)]
pub struct ClusterView {
    pub nodes: watch::Receiver<Arc<Snapshot>>,
    pub drains: watch::Receiver<Arc<Snapshot>>,
    pub jobs: watch::Receiver<Arc<Snapshot>>,
    pub live: watch::Receiver<Arc<Snapshot>>,
    /// Unix ms of etcd's last answer to this replica's ping (0: never).
    answered_ms: Arc<AtomicU64>,
    last_error: Arc<Mutex<Option<String>>>,
}

/// The four snapshots, taken together.
pub struct Snapshots {
    pub nodes: Arc<Snapshot>,
    pub drains: Arc<Snapshot>,
    pub jobs: Arc<Snapshot>,
    pub live: Arc<Snapshot>,
}

impl ClusterView {
    /// Start the watches and the ping; they run until `cancel`.
    pub fn start(store: &Store, cancel: CancellationToken) -> ClusterView {
        let k = &store.keys;
        let b = &store.backend;
        let view = ClusterView {
            nodes: watch_prefix(b.clone(), k.nodes(), cancel.clone()),
            drains: watch_prefix(b.clone(), k.drains(), cancel.clone()),
            jobs: watch_prefix(b.clone(), k.jobs(), cancel.clone()),
            live: watch_prefix(b.clone(), k.live(), cancel.clone()),
            answered_ms: Arc::default(),
            last_error: Arc::default(),
        };
        let (store, answered, last_error) = (
            store.clone(),
            view.answered_ms.clone(),
            view.last_error.clone(),
        );
        tokio::spawn(async move {
            let key = store.keys.election();
            loop {
                let r = tokio::time::timeout(STALE_AFTER, store.backend.list(&key)).await;
                match r {
                    Ok(Ok(_)) => {
                        answered.store(now_ms(), Ordering::SeqCst);
                        *last_error.lock().unwrap() = None;
                    }
                    Ok(Err(e)) => *last_error.lock().unwrap() = Some(e.to_string()),
                    Err(_) => {
                        *last_error.lock().unwrap() =
                            Some(format!("no answer within {} s", STALE_AFTER.as_secs()))
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(PING_EVERY) => {}
                    _ = cancel.cancelled() => return,
                }
            }
        });
        view
    }

    pub fn snapshots(&self) -> Snapshots {
        Snapshots {
            nodes: self.nodes.borrow().clone(),
            drains: self.drains.borrow().clone(),
            jobs: self.jobs.borrow().clone(),
            live: self.live.borrow().clone(),
        }
    }

    /// Seconds since etcd last answered this replica (None: never).
    pub fn age(&self) -> Option<f64> {
        match self.answered_ms.load(Ordering::SeqCst) {
            0 => None,
            t => Some(now_ms().saturating_sub(t) as f64 / 1000.0),
        }
    }

    /// The snapshots, if they are current: every watch has listed once and etcd answered
    /// within [`STALE_AFTER`]; else why not, in words.
    pub fn current(&self) -> Result<Snapshots, String> {
        let s = self.snapshots();
        if [&s.nodes, &s.drains, &s.jobs, &s.live]
            .iter()
            .any(|x| x.revision == 0)
        {
            return Err("this replica has not read the cluster's state from etcd yet".into());
        }
        let why = || {
            self.last_error
                .lock()
                .unwrap()
                .clone()
                .map(|e| format!(": {e}"))
                .unwrap_or_default()
        };
        match self.age() {
            Some(a) if a <= STALE_AFTER.as_secs_f64() => Ok(s),
            Some(a) => Err(format!(
                "etcd has not answered this replica for {a:.1} s{}; its view of the cluster may be stale",
                why()
            )),
            None => Err(format!("etcd has not answered this replica yet{}", why())),
        }
    }
}

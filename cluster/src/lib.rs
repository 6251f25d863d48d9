//! ductile's cluster layer: typed records, the etcd key layout, and the store over etcd.
//!
//! Invariant: only this crate knows the etcd key layout ([`keys`]) and talks to etcd
//! ([`etcd`]); everything above goes through [`store::Store`] and [`kv::KvBackend`].

pub mod access;
pub mod api;
pub mod check;
pub mod conformance;
pub mod error;
pub mod etcd;
pub mod fuzz;
pub mod hf;
pub mod keys;
pub mod kv;
pub mod lease;
pub mod lines;
pub mod memory;
pub mod modes;
pub mod pycmd;
pub mod recipe;
pub mod records;
pub mod relay;
pub mod schema;
pub mod series;
pub mod service;
pub mod store;
pub mod units;
pub mod watch;

pub use error::{ClusterError, Result};
pub use keys::Keys;
pub use kv::{KvBackend, LeaderKey};
pub use store::Store;

use std::sync::Arc;
use std::time::Duration;

/// Connect to etcd at comma-separated `endpoints` (`http://` optional), waiting up to `wait`
/// for a first answer.
pub async fn connect_etcd(endpoints: &str, wait: Duration) -> Result<Arc<dyn KvBackend>> {
    connect_etcd_with(&access::EtcdAccess::plain(endpoints), wait).await
}

/// Connect to etcd as `access` says (TLS, user), waiting up to `wait` for a first answer.
pub async fn connect_etcd_with(
    access: &access::EtcdAccess,
    wait: Duration,
) -> Result<Arc<dyn KvBackend>> {
    if access.endpoint_list().is_empty() {
        return Err(ClusterError::invalid("etcd", "no endpoints given"));
    }
    access
        .validate()
        .map_err(|reason| ClusterError::invalid("etcd", reason))?;
    Ok(Arc::new(
        etcd::EtcdBackend::connect_checked(access, wait).await?,
    ))
}

//! The one error type of the cluster crate.

use std::time::Duration;

/// Errors from the store, the lease keeper and the watch helper.
///
/// Each variant says whether retrying can help ([`ClusterError::is_retryable`]); callers use that
/// instead of guessing from the message.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// etcd could not be reached or the request failed in transport (connection refused, reset,
    /// deadline exceeded). Retryable.
    #[error("etcd at {endpoints} is unreachable during {op}: {source}")]
    Unavailable {
        endpoints: String,
        op: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The request timed out on our side.
    #[error("{op} timed out after {after:?}")]
    Timeout { op: &'static str, after: Duration },
    /// etcd refused the request (bad argument, permission, ...). Not retryable.
    #[error("etcd refused {op}: {message}")]
    Rejected { op: &'static str, message: String },
    /// The lease does not exist (any more): it expired or was revoked.
    #[error("lease {lease:x} not found (expired or revoked)")]
    LeaseNotFound { lease: i64 },
    /// A watch start revision has been compacted; the watcher must re-list.
    #[error("watch on {prefix} from revision {from} hit compaction at {compacted}")]
    Compacted {
        prefix: String,
        from: i64,
        compacted: i64,
    },
    /// A stored record could not be decoded.
    #[error("record at {key} is not valid {what}: {source}")]
    Decode {
        key: String,
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    /// A record failed validation before it was written.
    #[error("invalid {field}: {reason}")]
    Invalid { field: String, reason: String },
    /// A conditional write lost (another writer moved the key first, or we are not the leader).
    #[error("conditional write on {key} failed: {reason}")]
    Conflict { key: String, reason: String },
    /// The store is closed (in-memory backend dropped, shutdown).
    #[error("store closed")]
    Closed,
}

impl ClusterError {
    /// Whether the same request may succeed if sent again later. Exhaustive on purpose.
    pub fn is_retryable(&self) -> bool {
        match self {
            ClusterError::Unavailable { .. } | ClusterError::Timeout { .. } => true,
            ClusterError::Compacted { .. } => true,
            ClusterError::Rejected { .. }
            | ClusterError::LeaseNotFound { .. }
            | ClusterError::Decode { .. }
            | ClusterError::Invalid { .. }
            | ClusterError::Conflict { .. }
            | ClusterError::Closed => false,
        }
    }

    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ClusterError::Invalid {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

pub type Result<T, E = ClusterError> = std::result::Result<T, E>;

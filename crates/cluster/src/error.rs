//! The cluster's errors.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use warren_transport::TransportError;

use crate::state::Rejection;

/// Why a cluster operation failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// The operation needs a majority of the voting members and none could be
    /// reached within the bound: this node is in a minority (or too many
    /// members are down). Nothing was changed by this call unless
    /// `maybe_applied` is true, in which case the command was handed to a
    /// leader and may still commit (it will never commit twice).
    #[error(
        "{op}: no majority of the cluster answered within {waited:?} (voters: {voters:?}; unreachable: {unreachable:?}){}",
        if *maybe_applied { "; the command may still be applied" } else { "" }
    )]
    NoMajority {
        /// The operation that failed.
        op: &'static str,
        /// How long it waited.
        waited: Duration,
        /// The voting members.
        voters: Vec<String>,
        /// Voters the failure detector sees as down.
        unreachable: Vec<String>,
        /// Whether a leader received the command (it may commit later).
        maybe_applied: bool,
    },
    /// The state machine refused the command (see [`Rejection`]); nothing changed.
    #[error("command rejected: {0}")]
    Rejected(#[from] Rejection),
    /// At boot, no majority came up within the boot wait.
    #[error(
        "timed out after {waited:?} waiting for cluster nodes {waiting_for:?}: start them, \
         or, if they are gone for good, remove them with \
         `forget_cluster_node --offline <node>` on this node's data directory"
    )]
    BootTimeout {
        /// How long it waited.
        waited: Duration,
        /// The members it waited for.
        waiting_for: Vec<String>,
    },
    /// Joining a cluster failed.
    #[error("could not join the cluster via {via}: {reason}")]
    JoinFailed {
        /// The member contacted.
        via: String,
        /// Why.
        reason: String,
    },
    /// The node named is not a member of the cluster.
    #[error("{0} is not a member of the cluster")]
    NotAMember(String),
    /// This node was removed from the cluster (`forget_cluster_node`) while it
    /// was stopped; its data directory is stale (RabbitMQ's `inconsistent_cluster`).
    #[error(
        "node {0} was removed from the cluster (forget_cluster_node): \
         wipe its data directory, then start it with --join to rejoin"
    )]
    Removed(String),
    /// `forget_cluster_node` on a node that is running: stop it first.
    #[error("node {0} is running: stop it before forgetting it")]
    NodeRunning(String),
    /// A node cannot forget itself (use a graceful leave instead).
    #[error("a node cannot forget itself: run the command on another member")]
    ForgetSelf,
    /// Storage (the data directory) failed.
    #[error("storage at {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: Arc<std::io::Error>,
    },
    /// The data directory holds no usable cluster state.
    #[error("{0}")]
    BadDataDir(String),
    /// The transport failed (listening on the peer address).
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The configuration is invalid.
    #[error("invalid cluster configuration: {0}")]
    Config(String),
    /// The node's Raft engine stopped (shut down, or a storage failure).
    #[error("the metadata store is stopped: {0}")]
    Stopped(String),
    /// A peer or the leader reported a failure.
    #[error("{0}")]
    Remote(String),
}

impl ClusterError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source: Arc::new(source),
        }
    }
}

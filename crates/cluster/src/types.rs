//! The openraft type configuration and node identities.

use std::fmt;
use std::io::Cursor;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use warren_wire::NodeName;

use crate::state::{Command, CommandResponse};

openraft::declare_raft_types!(
    /// Warren's openraft type configuration.
    pub TypeConfig:
        D = Command,
        R = CommandResponse,
        NodeId = u64,
        Node = PeerNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// A Raft node id: derived from the node name (see [`node_id`]).
pub type NodeId = u64;

/// What Raft knows about a member: its name and peer address.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PeerNode {
    /// The node name.
    pub name: String,
    /// The address it listens on for peers.
    pub addr: String,
}

impl fmt::Display for PeerNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.name, self.addr)
    }
}

/// The Raft node id of a node name: the first 8 bytes of SHA-256 of the name.
///
/// Stable across restarts and hosts (so a data directory moved to a new host
/// under the same node name keeps its identity).
pub fn node_id(name: &NodeName) -> NodeId {
    let digest = Sha256::digest(name.as_str().as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&digest[..8]);
    // Zero is openraft's default id; keep clear of it.
    u64::from_be_bytes(b).max(1)
}

/// Shorthands for openraft types under [`TypeConfig`].
pub(crate) type Raft = openraft::Raft<TypeConfig>;
pub(crate) type Entry = openraft::Entry<TypeConfig>;
pub(crate) type LogId = openraft::LogId<NodeId>;
pub(crate) type Vote = openraft::Vote<NodeId>;
pub(crate) type StoredMembership = openraft::StoredMembership<NodeId, PeerNode>;
pub(crate) type SnapshotMeta = openraft::SnapshotMeta<NodeId, PeerNode>;
pub(crate) type StorageError = openraft::StorageError<NodeId>;

//! Tools that work on a **stopped** node's data directory.
//!
//! [`forget_cluster_node_offline`] is RabbitMQ's `forget_cluster_node
//! --offline`: when the nodes that could form a majority are gone for good,
//! it rewrites this node's membership so that it can start (alone, or with
//! the members that remain). It is explicit, logged and **unsafe**: it
//! bypasses consensus. Run it only while every other member is stopped, and
//! never start a forgotten node again with its old data directory.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

use openraft::{EntryPayload, Membership, StoredMembership};
use warren_wire::NodeName;

use crate::error::ClusterError;
use crate::state::{Command, LogIndex, Metadata};
use crate::store::{
    LogFiles, SmState, SnapshotState, StoredSnapshot, apply_entry, raft_dir, read_snapshot,
    replace_offline,
};
use crate::types::{NodeId, PeerNode, SnapshotMeta, node_id};

/// What [`forget_cluster_node_offline`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OfflineForget {
    /// The members removed.
    pub forgotten: Vec<String>,
    /// The voting members after the change.
    pub voters: Vec<String>,
    /// The non-voting members after the change.
    pub learners: Vec<String>,
    /// The log index the new state is stamped at.
    pub at_index: LogIndex,
}

/// The state of a data directory as its log and snapshot hold it.
struct Replayed {
    state: SmState,
    membership: Membership<NodeId, PeerNode>,
}

fn replay(data_dir: &Path) -> Result<Replayed, ClusterError> {
    let dir = raft_dir(data_dir);
    if !dir.is_dir() {
        return Err(ClusterError::BadDataDir(format!(
            "{} holds no cluster state",
            data_dir.display()
        )));
    }
    let files = LogFiles::load(&dir).map_err(|e| ClusterError::io(&dir, e))?;
    let snap = read_snapshot(&dir).map_err(|e| ClusterError::io(&dir, e))?;
    let mut state = SmState::default();
    if let Some(s) = &snap {
        let content: SnapshotState = postcard::from_bytes(&s.data)
            .map_err(|e| ClusterError::BadDataDir(format!("corrupt snapshot: {e}")))?;
        state.last_applied = content.last_applied;
        state.membership = content.membership;
        state.metadata = Arc::new(content.metadata);
    }
    // Apply the whole log, committed or not: this node's newest knowledge.
    for (entry, _) in files.entries.values() {
        if state
            .last_applied
            .is_some_and(|l| entry.log_id.index <= l.index)
        {
            continue;
        }
        apply_entry(&mut state, entry);
    }
    let membership = state.membership.membership().clone();
    if state.last_applied.is_none() {
        return Err(ClusterError::BadDataDir(format!(
            "{} holds no cluster state",
            data_dir.display()
        )));
    }
    Ok(Replayed { state, membership })
}

/// Removes `forget` from the membership stored in the stopped node `me`'s
/// data directory, making `me` a voter, so that it can start without them
/// (seed scenario 4: the last node to stop is gone for good).
///
/// Everything in the node's log is kept (also entries a majority may never
/// have committed). Queues mastered on a forgotten node get their oldest
/// synchronised mirror as master, or are deleted (as online forget does).
///
/// Errors: a node not in the membership ([`ClusterError::NotAMember`]),
/// forgetting `me` ([`ClusterError::ForgetSelf`]), a directory without
/// cluster state ([`ClusterError::BadDataDir`]).
pub fn forget_cluster_node_offline(
    data_dir: &Path,
    me: &NodeName,
    forget: &[NodeName],
) -> Result<OfflineForget, ClusterError> {
    let Replayed {
        mut state,
        membership,
    } = replay(data_dir)?;
    let nodes: BTreeMap<NodeId, PeerNode> =
        membership.nodes().map(|(id, n)| (*id, n.clone())).collect();
    let my_id = node_id(me);
    let Some(my_node) = nodes.get(&my_id).cloned() else {
        return Err(ClusterError::NotAMember(me.to_string()));
    };
    let mut gone = BTreeSet::new();
    for f in forget {
        let id = node_id(f);
        if id == my_id {
            return Err(ClusterError::ForgetSelf);
        }
        if !nodes.contains_key(&id) {
            return Err(ClusterError::NotAMember(f.to_string()));
        }
        gone.insert(id);
    }
    let mut voters: BTreeSet<NodeId> = membership
        .get_joint_config()
        .iter()
        .flatten()
        .copied()
        .filter(|v| !gone.contains(v))
        .collect();
    voters.insert(my_id);
    let mut kept: BTreeMap<NodeId, PeerNode> = nodes
        .into_iter()
        .filter(|(id, _)| !gone.contains(id))
        .collect();
    kept.insert(my_id, my_node);
    let new_membership = Membership::new(vec![voters.clone()], kept.clone());
    let Some(last) = state.last_applied else {
        return Err(ClusterError::BadDataDir("no applied entries".into()));
    };
    state.membership = StoredMembership::new(Some(last), new_membership);
    let members: BTreeMap<String, String> = kept
        .values()
        .map(|n| (n.name.clone(), n.addr.clone()))
        .collect();
    // Queues whose master is forgotten with no mirror left stay, served by
    // this node from whatever it holds.
    Arc::make_mut(&mut state.metadata).apply_membership_with(
        last.index,
        &members,
        Some(me.as_str()),
    );
    let content = SnapshotState {
        last_applied: Some(last),
        membership: state.membership.clone(),
        metadata: (*state.metadata).clone(),
    };
    let data = postcard::to_stdvec(&content)
        .map_err(|e| ClusterError::BadDataDir(format!("cannot encode the new state: {e}")))?;
    let snap = StoredSnapshot {
        meta: SnapshotMeta {
            last_log_id: Some(last),
            last_membership: state.membership.clone(),
            snapshot_id: format!("offline-forget-{}-{}", last.leader_id, last.index),
        },
        data,
    };
    let dir = raft_dir(data_dir);
    replace_offline(&dir, &snap, last).map_err(|e| ClusterError::io(&dir, e))?;
    let name_of = |id: &NodeId| kept.get(id).map(|n| n.name.clone()).unwrap_or_default();
    let report = OfflineForget {
        forgotten: forget.iter().map(ToString::to_string).collect(),
        voters: voters.iter().map(name_of).collect(),
        learners: kept
            .keys()
            .filter(|id| !voters.contains(id))
            .map(name_of)
            .collect(),
        at_index: last.index,
    };
    tracing::warn!(
        node = %me,
        data_dir = %data_dir.display(),
        forgotten = ?report.forgotten,
        voters = ?report.voters,
        "UNSAFE: forgot cluster nodes offline; this node's state is now authoritative"
    );
    Ok(report)
}

/// Every command in a data directory's log (after its snapshot), with its
/// log index, committed or not: for diagnostics and tests. Safe on a
/// running node's directory (it only reads).
pub fn read_log_commands(data_dir: &Path) -> Result<Vec<(LogIndex, Command)>, ClusterError> {
    let dir = raft_dir(data_dir);
    let files = LogFiles::load(&dir).map_err(|e| ClusterError::io(&dir, e))?;
    Ok(files
        .entries
        .values()
        .filter_map(|(e, _)| match &e.payload {
            EntryPayload::Normal(c) => Some((e.log_id.index, c.clone())),
            _ => None,
        })
        .collect())
}

/// The metadata a stopped node's data directory holds (snapshot plus its
/// whole log, committed or not).
pub fn read_metadata_offline(data_dir: &Path) -> Result<Metadata, ClusterError> {
    Ok((*replay(data_dir)?.state.metadata).clone())
}

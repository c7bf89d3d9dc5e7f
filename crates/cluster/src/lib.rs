//! Warren's cluster: membership, failure detection and the metadata store.
//!
//! The cluster's metadata (nodes, vhosts, users and permissions, policies,
//! exchanges, bindings, and queue records with their master, mirrors,
//! synchronised mirrors and view version) is a state machine ([`Metadata`])
//! replicated by Raft (the `openraft` crate, 0.9) over Warren's own
//! [`Transport`](warren_transport::Transport): TCP, QUIC or in-memory. Only a
//! majority of the voting members decides, so a node cut off in a minority
//! can read what it has but cannot change anything: that is what keeps
//! RabbitMQ's split-brain (two masters for one queue) out of Warren.
//!
//! # Using it
//!
//! [`Cluster::start`] runs a node: it bootstraps a one-node cluster, joins
//! one through [`ClusterConfig::join`], or, on restart, waits for a majority.
//! Then:
//!
//! - [`Cluster::write`] commits a typed [`Command`]; [`Cluster::set_queue_view`]
//!   is the compare-and-set a queue's master/mirrors change through, and
//!   [`Cluster::set_ring_view`] the one a GM ring's (opaque) view changes
//!   through, so a GM `ViewAuthority` can be backed by the store.
//! - [`Cluster::local`] reads what this node has applied (possibly stale);
//!   [`Cluster::read_linearizable`] confirms with a majority first;
//!   [`Cluster::metadata_changes`] wakes on every applied change.
//! - [`Cluster::cluster_status`], [`Cluster::forget_cluster_node`],
//!   [`Cluster::leave`] (graceful stop) and [`Cluster::shutdown`] (abrupt).
//! - [`Cluster::subscribe`] and [`Cluster::up_nodes`]: node up/down from the
//!   failure detector (heartbeats over the transport; `failure_timeout`).
//!   The heartbeats also carry a pre-vote: a node stands for Raft election
//!   only while a majority says it has no live leader, so a node cut off
//!   cannot depose the leader when it comes back. When the leader's process
//!   is gone (its address refuses), the survivors stand at once, each round
//!   a pre-vote of its own: a majority answered this node's ask (a number
//!   the answer echoes) and has no live leader.
//! - [`offline::forget_cluster_node_offline`] on a stopped node's data directory.
//!
//! ```no_run
//! # async fn demo() -> Result<(), warren_cluster::ClusterError> {
//! use std::sync::Arc;
//! use warren_cluster::{Cluster, ClusterConfig, Command};
//! use warren_transport::mem::MemNetwork;
//! use warren_transport::{ClusterSecret, NodeName, PeerAddr, TransportConfig};
//!
//! let net = MemNetwork::new(1);
//! let name = NodeName::new("warren@a").unwrap();
//! let transport = Arc::new(net.transport(TransportConfig::new(
//!     name.clone(),
//!     ClusterSecret::new("secret"),
//! )));
//! let config = ClusterConfig::new(name, PeerAddr::new("a"), "/var/lib/warren", transport);
//! let cluster = Cluster::start(config).await?; // bootstraps: no `join`, no state
//! cluster.write(Command::PutVhost { name: "/".into() }).await?;
//! assert!(cluster.local().vhosts.contains("/"));
//! cluster.leave().await?; // graceful stop
//! # Ok(())
//! # }
//! ```
//!
//! Every operation that needs a majority is bounded by
//! [`ClusterConfig::command_timeout`] and fails with
//! [`ClusterError::NoMajority`]; it never hangs. A command is handed to a
//! leader at most once, so it never commits twice.
//!
//! # Boot ordering
//!
//! A restarted node waits until it sees a leader, logging every few seconds
//! which voters it waits for, for at most `boot_wait_retries ×
//! boot_wait_timeout` (default 10 × 30 s, like RabbitMQ); then
//! [`Cluster::start`] fails with [`ClusterError::BootTimeout`], which names
//! the nodes to start or to forget. Nodes restarted within that window find
//! each other whatever the order. A node that was forgotten while it was
//! stopped is told so ([`ClusterError::Removed`]) and must be wiped before it
//! joins again; members refuse its votes, so it cannot disturb the cluster.
//!
//! # Two-node clusters
//!
//! Raft needs a majority of the voters, and the majority of two is two. So:
//!
//! - A two-node cluster **survives a clean stop of either node**: a node that
//!   stops with [`Cluster::leave`] first removes itself from the voters while
//!   the other can still commit, leaving a one-voter cluster that carries on
//!   alone. The node that stops last stays a voter and may start first; the
//!   other rejoins as a voter when it starts again (in either order, within
//!   the boot wait).
//! - It does **not** survive the crash of either node (or a partition between
//!   them): the survivor cannot commit, so queue views cannot change, until
//!   the other comes back or an operator runs `forget_cluster_node` (offline
//!   on a stopped node, see [`offline`]).
//!
//! Three nodes (or five) are recommended: they survive the crash of any one
//! (or two) without an operator.
//!
//! # Operating a cluster
//!
//! - **Form**: start the first node without `join`; it is a one-node cluster.
//! - **Grow**: start a new node (empty data directory) with `join` set to any
//!   running member. It is added as a learner, catches up (by snapshot if the
//!   log was compacted), then becomes a voter. Joining again is a no-op.
//!   (The `warren` node's `join_cluster` resets a running node that is alone
//!   in its cluster and restarts it this way.)
//! - **Shrink**: stop the node gracefully ([`Cluster::leave`]), then run
//!   [`Cluster::forget_cluster_node`] on any running member; a running node
//!   cannot be forgotten. Its queues lose it as master or mirror (see
//!   [`Metadata::apply_membership`]).
//! - **Restart**: nodes restarted from their data directories find each
//!   other (a node that comes back at a new address tells the others). Start
//!   the last node that stopped first if you can; any majority of voters
//!   restarted within the boot wait also works.
//! - **Recover** when nodes are lost for good (seed 000 §2.5): if a majority
//!   survives, `forget_cluster_node` the lost ones from a running member
//!   (scenario 3). If not, stop everything and run
//!   [`offline::forget_cluster_node_offline`] on a survivor's data directory
//!   (scenario 4), start it alone, then join new nodes to it. A data directory
//!   copied to a new host under the same node name is that node (scenario 5).
//!
//! # On disk
//!
//! `<data_dir>/raft/` holds the Raft log (fsynced appends with CRCs; a torn
//! tail is cut off at start), the vote, and the latest snapshot; see the
//! `store` module's docs.

mod cluster;
mod error;
pub mod offline;
mod peers;
mod rpc;
mod state;
mod store;
mod types;

pub use cluster::{Cluster, ClusterConfig, ClusterStatus, MemberStatus, NodeEvent};
pub use error::ClusterError;
pub use state::{
    ArgValue, Arguments, BindingRecord, Command, CommandResponse, DestinationKind, ExchangeRecord,
    Listener, LogIndex, Metadata, NodeRecord, Outcome, Permissions, PolicyRecord, QueueRecord,
    QueueView, Rejection, UserRecord,
};
pub use types::{NodeId, PeerNode, TypeConfig, node_id};

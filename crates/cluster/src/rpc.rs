//! The metadata store's RPCs, and openraft's network over [`Peers`].

use std::io::Cursor;
use std::time::Duration;

use openraft::error::{
    Fatal, InstallSnapshotError, NetworkError, RPCError, RaftError, ReplicationClosed,
    StreamingError, Unreachable,
};
use openraft::network::{Backoff, RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    SnapshotResponse, VoteRequest, VoteResponse,
};
use openraft::{OptionalSend, Snapshot};
use serde::{Deserialize, Serialize};
use warren_transport::PeerAddr;
use warren_wire::NodeName;

use crate::peers::{CallError, Peers};
use crate::state::{Command, CommandResponse};
use crate::types::{NodeId, PeerNode, SnapshotMeta, TypeConfig, Vote};

/// A request from one node to another.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Request {
    AppendEntries(AppendEntriesRequest<TypeConfig>),
    Vote(VoteRequest<NodeId>),
    Snapshot {
        vote: Vote,
        meta: SnapshotMeta,
        data: Vec<u8>,
    },
    Admin(AdminRequest),
    /// Answer once this node has applied the log up to `index` (or after
    /// [`APPLIED_WAIT`](crate::cluster::APPLIED_WAIT)): a client's metadata
    /// change is answered only once every running node knows it.
    Applied {
        index: u64,
    },
}

/// The answer to a [`Request`]; remote failures travel as text.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Response {
    AppendEntries(Result<AppendEntriesResponse<NodeId>, String>),
    Vote(Result<VoteResponse<NodeId>, String>),
    Snapshot(Result<SnapshotResponse<NodeId>, String>),
    Admin(AdminResponse),
    /// Whether the node has applied the asked index.
    Applied(bool),
}

/// Requests that only the leader can serve; a follower answers `NotLeader`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum AdminRequest {
    /// Commit a command.
    Write(Command),
    /// Confirm leadership and return the index a linearizable read must see.
    ReadIndex,
    /// Add a node as a learner, wait for it to catch up, make it a voter.
    Join { name: String, addr: String },
    /// Turn a member into a learner (graceful leave).
    Demote { name: String },
    /// Remove a member entirely (forget_cluster_node).
    Forget { name: String },
    /// Start an election now (leadership hand-off to the receiver).
    Elect,
}

/// The answer to an [`AdminRequest`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum AdminResponse {
    /// The state machine's answer and the entry's log index.
    Written(CommandResponse, u64),
    ReadIndex(u64),
    Done,
    NotLeader {
        leader: Option<PeerNode>,
    },
    NoMajority {
        maybe_applied: bool,
    },
    NodeRunning(String),
    NotAMember(String),
    Failed(String),
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Remote(String);

fn rpc_err<E: std::error::Error>(e: CallError) -> RPCError<NodeId, PeerNode, E> {
    match e {
        CallError::Unreachable { .. } => RPCError::Unreachable(Unreachable::new(&e)),
        CallError::Timeout { .. } | CallError::Lost { .. } => {
            RPCError::Unreachable(Unreachable::new(&e))
        }
    }
}

/// openraft's network: one client per target, all over the node's [`Peers`].
#[derive(Debug, Clone)]
pub(crate) struct Network {
    pub(crate) peers: Peers,
    pub(crate) backoff: Duration,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = NetworkClient;

    async fn new_client(&mut self, _target: NodeId, node: &PeerNode) -> NetworkClient {
        NetworkClient {
            peers: self.peers.clone(),
            name: NodeName::new(node.name.clone()).ok(),
            addr: PeerAddr::new(node.addr.clone()),
            backoff: self.backoff,
        }
    }
}

/// openraft's client to one target node.
#[derive(Debug)]
pub(crate) struct NetworkClient {
    peers: Peers,
    name: Option<NodeName>,
    addr: PeerAddr,
    backoff: Duration,
}

impl NetworkClient {
    async fn call(&self, req: Request, timeout: Duration) -> Result<Response, CallError> {
        let Some(name) = &self.name else {
            return Err(CallError::Unreachable {
                peer: self.addr.to_string(),
                reason: "invalid node name in membership".into(),
            });
        };
        self.peers.call(Some(name), &self.addr, req, timeout).await
    }
}

fn unexpected<E: std::error::Error>() -> RPCError<NodeId, PeerNode, E> {
    RPCError::Network(NetworkError::new(&Remote(
        "unexpected response type".into(),
    )))
}

impl RaftNetwork<TypeConfig> for NetworkClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, PeerNode, RaftError<NodeId>>> {
        match self
            .call(Request::AppendEntries(rpc), option.hard_ttl())
            .await
            .map_err(rpc_err)?
        {
            Response::AppendEntries(Ok(r)) => Ok(r),
            Response::AppendEntries(Err(e)) => {
                Err(RPCError::Network(NetworkError::new(&Remote(e))))
            }
            _ => Err(unexpected()),
        }
    }

    async fn install_snapshot(
        &mut self,
        _rpc: InstallSnapshotRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, PeerNode, RaftError<NodeId, InstallSnapshotError>>,
    > {
        // Snapshots travel whole through `full_snapshot`.
        Err(RPCError::Network(NetworkError::new(&Remote(
            "chunked snapshots are not used; snapshots are sent whole".into(),
        ))))
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, PeerNode, RaftError<NodeId>>> {
        match self
            .call(Request::Vote(rpc), option.hard_ttl())
            .await
            .map_err(rpc_err)?
        {
            Response::Vote(Ok(r)) => Ok(r),
            Response::Vote(Err(e)) => Err(RPCError::Network(NetworkError::new(&Remote(e)))),
            _ => Err(unexpected()),
        }
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: Snapshot<TypeConfig>,
        cancel: impl Future<Output = ReplicationClosed> + OptionalSend + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<NodeId>, StreamingError<TypeConfig, Fatal<NodeId>>> {
        let data = Cursor::into_inner(*snapshot.snapshot);
        let req = Request::Snapshot {
            vote,
            meta: snapshot.meta,
            data,
        };
        let call = self.call(req, option.hard_ttl().max(Duration::from_secs(5)));
        let resp = tokio::select! {
            r = call => r,
            closed = cancel => return Err(StreamingError::Closed(closed)),
        };
        match resp {
            Ok(Response::Snapshot(Ok(r))) => Ok(r),
            Ok(Response::Snapshot(Err(e))) => {
                Err(StreamingError::Network(NetworkError::new(&Remote(e))))
            }
            Ok(_) => Err(StreamingError::Network(NetworkError::new(&Remote(
                "unexpected response type".into(),
            )))),
            Err(e) => Err(StreamingError::Unreachable(Unreachable::new(&e))),
        }
    }

    fn backoff(&self) -> Backoff {
        Backoff::new(std::iter::repeat(self.backoff))
    }
}

#[cfg(test)]
mod tests {
    use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId, Membership};

    use super::*;

    /// Every openraft type the RPCs carry survives postcard.
    #[test]
    fn requests_round_trip_through_postcard() {
        let node = |n: &str| PeerNode {
            name: n.into(),
            addr: format!("{n}:1"),
        };
        let lid = LogId::new(CommittedLeaderId::new(2, 9), 5);
        let membership = Membership::new(
            vec![[1u64, 2].into()],
            [(1u64, node("a")), (2, node("b")), (3, node("c"))]
                .into_iter()
                .collect::<std::collections::BTreeMap<_, _>>(),
        );
        let req = Request::AppendEntries(AppendEntriesRequest {
            vote: Vote::new_committed(2, 9),
            prev_log_id: Some(lid),
            entries: vec![
                Entry {
                    log_id: LogId::new(CommittedLeaderId::new(2, 9), 6),
                    payload: EntryPayload::Membership(membership.clone()),
                },
                Entry {
                    log_id: LogId::new(CommittedLeaderId::new(2, 9), 7),
                    payload: EntryPayload::Normal(Command::PutVhost { name: "/".into() }),
                },
                Entry {
                    log_id: LogId::new(CommittedLeaderId::new(2, 9), 8),
                    payload: EntryPayload::Blank,
                },
            ],
            leader_commit: Some(lid),
        });
        let bytes = warren_wire::encode_message(&req).unwrap();
        let back: Request = warren_wire::decode_message(&bytes).unwrap();
        assert_eq!(format!("{req:?}"), format!("{back:?}"));

        let snap = Request::Snapshot {
            vote: Vote::new(3, 1),
            meta: SnapshotMeta {
                last_log_id: Some(lid),
                last_membership: openraft::StoredMembership::new(Some(lid), membership),
                snapshot_id: "s".into(),
            },
            data: vec![1, 2, 3],
        };
        let bytes = warren_wire::encode_message(&snap).unwrap();
        let back: Request = warren_wire::decode_message(&bytes).unwrap();
        assert_eq!(format!("{snap:?}"), format!("{back:?}"));
    }
}

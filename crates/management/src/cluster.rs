//! Cluster membership through the API: `GET /api/cluster` (what
//! `warrenctl cluster_status` prints), `POST /api/cluster/join`
//! (`join_cluster`: 200 when the node is already a member, 202 when it was
//! reset and restarts to join) and `DELETE /api/cluster/nodes/{name}`
//! (`forget_cluster_node`), served by whatever implements [`ClusterControl`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse as _, Response};
use serde_json::{Value, json};

use crate::Management;

/// A boxed future returned by [`ClusterControl`]'s and
/// [`NodeControl`](crate::NodeControl)'s verbs.
pub type ClusterFuture = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

/// What [`ClusterControl::join`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JoinOutcome {
    /// The node already belongs to the seed's cluster: nothing changed.
    AlreadyMember,
    /// The node was reset (its own metadata and messages discarded) and
    /// restarts to join the cluster of `seed_node`.
    Restarting {
        /// The name of the member that answered at the seed address.
        seed_node: String,
    },
}

/// The boxed future of [`ClusterControl::join`].
pub type JoinFuture = Pin<Box<dyn Future<Output = Result<JoinOutcome, String>> + Send>>;

/// One member as [`ClusterControl::status`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterMember {
    /// The node name.
    pub name: String,
    /// Its peer address.
    pub addr: String,
    /// Whether it votes in the metadata store.
    pub voter: bool,
    /// Whether it is running as the answering node sees it.
    pub running: bool,
    /// Its client-facing listeners as it recorded them: (RabbitMQ's
    /// protocol name, `IP:PORT`).
    pub listeners: Vec<(String, String)>,
}

/// What `cluster_status` shows.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClusterInfo {
    /// The node that answered.
    pub node: String,
    /// The metadata store's leader, if known.
    pub leader: Option<String>,
    /// Every member.
    pub members: Vec<ClusterMember>,
}

/// The node's cluster membership, as the API drives it.
pub trait ClusterControl: Send + Sync + fmt::Debug {
    /// Members, leader, running nodes.
    fn status(&self) -> ClusterInfo;
    /// Joins the cluster that the member at `seed` (a peer address, or the
    /// name of a member of this node's own cluster) belongs to.
    fn join(&self, seed: &str) -> JoinFuture;
    /// Removes a stopped member from the cluster.
    fn forget(&self, node: &str) -> ClusterFuture;
}

fn error(status: StatusCode, reason: impl Into<String>) -> Response {
    json_response(
        status,
        &json!({"error": "bad_request", "reason": reason.into()}),
    )
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

fn no_cluster() -> Response {
    error(
        StatusCode::BAD_REQUEST,
        "this node runs alone (started without --peer-addr)",
    )
}

fn info_json(s: &Management) -> Value {
    let info = s.cluster.as_ref().map_or_else(
        || ClusterInfo {
            node: s.node.clone(),
            leader: None,
            members: vec![ClusterMember {
                name: s.node.clone(),
                addr: String::new(),
                voter: true,
                running: true,
                listeners: Vec::new(),
            }],
        },
        |c| c.status(),
    );
    let names: Vec<&str> = info.members.iter().map(|m| m.name.as_str()).collect();
    let running: Vec<&str> = info
        .members
        .iter()
        .filter(|m| m.running)
        .map(|m| m.name.as_str())
        .collect();
    json!({
        "node": info.node,
        "clustered": s.cluster.is_some(),
        "leader": info.leader,
        "disk_nodes": names,
        "running_nodes": running,
        "members": info.members.iter().map(|m| json!({
            "name": m.name, "peer_addr": m.addr, "voter": m.voter, "running": m.running,
        })).collect::<Vec<_>>(),
    })
}

/// `GET /api/cluster`.
pub(crate) async fn status(State(s): State<Management>) -> Response {
    json_response(StatusCode::OK, &info_json(&s))
}

/// `POST /api/cluster/join` with `{"node": "HOST:PORT"}`.
pub(crate) async fn join(State(s): State<Management>, body: Bytes) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let Some(seed) = body.get("node").and_then(Value::as_str) else {
        return error(
            StatusCode::BAD_REQUEST,
            "expected {\"node\": \"HOST:PORT\"}",
        );
    };
    let Some(c) = s.cluster.clone() else {
        return no_cluster();
    };
    match c.join(seed).await {
        Ok(JoinOutcome::AlreadyMember) => json_response(
            StatusCode::OK,
            &json!({"node": c.status().node, "seed": seed, "already_member": true}),
        ),
        Ok(JoinOutcome::Restarting { seed_node }) => json_response(
            StatusCode::ACCEPTED,
            &json!({
                "node": c.status().node, "seed": seed, "seed_node": seed_node,
                "already_member": false, "reset": true,
            }),
        ),
        Err(e) => error(StatusCode::BAD_REQUEST, e),
    }
}

/// `DELETE /api/cluster/nodes/{name}`.
pub(crate) async fn forget(State(s): State<Management>, Path(name): Path<String>) -> Response {
    let Some(c) = s.cluster.clone() else {
        return no_cluster();
    };
    match c.forget(&name).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => error(StatusCode::BAD_REQUEST, e),
    }
}

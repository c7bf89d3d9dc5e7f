//! `warrenctl join_cluster` with real processes, RabbitMQ's workflow:
//! `stop_app`, `join_cluster SEED`, `start_app` moves a node that runs its
//! own one-node cluster into another cluster (it is reset on the way).
//! Refusals leave the node as it was: the app still running, an
//! unreachable seed, a seed with another cluster secret or the same name.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{Node, eventually};
use futures::StreamExt as _;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use serde_json::{Value, json};

/// `cluster_status`'s running nodes, sorted.
fn running_nodes(n: &Node) -> Vec<String> {
    let out = n.ctl(&["--formatter", "json", "cluster_status"]);
    let v: Value = serde_json::from_str(out.ok()).expect("cluster_status JSON");
    let mut names: Vec<String> = v["running_nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n.as_str().map(str::to_owned))
        .collect();
    names.sort();
    names
}

fn has_queue(n: &Node, name: &str) -> bool {
    n.http("GET", &format!("/api/queues/%2F/{name}"), None).0 == 200
}

fn declare_queue(n: &Node, name: &str) {
    let (status, v) = n.http(
        "PUT",
        &format!("/api/queues/%2F/{name}"),
        Some(&json!({"durable": true})),
    );
    assert!((200..300).contains(&status), "declare {name}: {status} {v}");
}

/// A node is unchanged by a refused join: alone in its cluster, its own
/// queue still there, its app as it was.
fn assert_unchanged(b: &Node, app: &str) {
    assert_eq!(running_nodes(b), vec!["warren@b"]);
    assert!(
        has_queue(b, "b.own"),
        "b's own queue survives a refused join"
    );
    let (_, node) = b.http("GET", "/api/nodes/warren%40b", None);
    let running = app == "running";
    assert_eq!(node["app_running"], running, "{node}");
}

fn secret(root: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let path = root.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn join_cluster_stop_app_join_start_app() {
    let root = tempfile::tempdir().unwrap();
    let shared = secret(root.path(), "secret", "join-test-secret\n");
    let a = Node::start_clustered("warren@a", &root.path().join("a"), &shared);
    let b = Node::start_clustered("warren@b", &root.path().join("b"), &shared);
    assert!(!a.peers.is_empty() && !b.peers.is_empty(), "peer addresses");

    // A's cluster has a policy and a mirrored durable queue; B has a queue
    // of its own, which joining discards.
    a.ctl(&[
        "set_policy",
        "ha-all",
        "^ha\\.",
        r#"{"ha-mode":"all","ha-sync-mode":"automatic"}"#,
    ])
    .ok();
    declare_queue(&a, "ha.q");
    declare_queue(&b, "b.own");

    // Refused while B's app runs.
    let r = b.ctl(&["join_cluster", &a.peers]);
    assert_ne!(r.code, 0, "{r:?}");
    assert!(r.err.contains("app is running"), "{r:?}");
    assert!(r.err.contains("stop_app"), "{r:?}");
    assert_unchanged(&b, "running");

    b.ctl(&["stop_app"]).ok();

    // An unreachable seed: a port nothing listens on.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_addr = dead.local_addr().unwrap().to_string();
    drop(dead);
    let r = b.ctl(&["join_cluster", &dead_addr]);
    assert_ne!(r.code, 0, "{r:?}");
    assert!(r.err.contains(&dead_addr), "names the seed: {r:?}");
    assert!(r.err.contains("unchanged"), "{r:?}");
    assert_unchanged(&b, "stopped");

    // A seed with another cluster secret.
    let other = secret(root.path(), "other-secret", "another-secret\n");
    let c = Node::start_clustered("warren@c", &root.path().join("c"), &other);
    let r = b.ctl(&["join_cluster", &c.peers]);
    assert_ne!(r.code, 0, "{r:?}");
    assert!(r.err.contains(&c.peers), "names the seed: {r:?}");
    assert!(r.err.contains("secret"), "says why: {r:?}");
    assert_unchanged(&b, "stopped");
    drop(c);

    // A seed with the same node name.
    let twin = Node::start_clustered("warren@b", &root.path().join("twin"), &shared);
    let r = b.ctl(&["join_cluster", &twin.peers]);
    assert_ne!(r.code, 0, "{r:?}");
    assert!(r.err.contains("names clash"), "{r:?}");
    assert_unchanged(&b, "stopped");
    drop(twin);

    // The join: B is reset and restarts (same process, ports and data
    // directory) as a member of A's cluster, its app stopped.
    let r = b.ctl(&["join_cluster", &a.peers]);
    let out = r.ok();
    assert!(out.contains("Clustering node warren@b with"), "{out}");
    assert!(out.contains("reset") && out.contains("discarded"), "{out}");
    assert!(out.contains("start_app"), "{out}");
    let (_, node) = b.http("GET", "/api/nodes/warren%40b", None);
    assert_eq!(node["app_running"], false, "{node}");
    b.ctl(&["start_app"]).ok();

    for n in [&a, &b] {
        eventually("both nodes running in cluster_status", || {
            running_nodes(n) == vec!["warren@a", "warren@b"]
        });
    }
    // B has A's metadata and none of its own.
    assert!(!has_queue(&b, "b.own"), "the reset discarded b's own queue");
    assert!(has_queue(&b, "ha.q"));
    let (_, policy) = b.http("GET", "/api/policies/%2F/ha-all", None);
    assert_eq!(policy["pattern"], "^ha\\.", "{policy}");
    // The reconciler places a mirror of ha.q on B.
    eventually("a synchronised mirror of ha.q on b", || {
        let (_, q) = a.http("GET", "/api/queues/%2F/ha.q", None);
        q["synchronised_slave_nodes"]
            .as_array()
            .is_some_and(|s| s.iter().any(|n| n == "warren@b"))
    });

    // Published on B (forwarded to the master on A), consumed on A.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let conn = Connection::connect(&b.amqp_url(), ConnectionProperties::default())
            .await
            .expect("connect to b");
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let confirm = ch
            .basic_publish(
                "".into(),
                "ha.q".into(),
                BasicPublishOptions::default(),
                b"from b",
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack(), "{confirm:?}");
        conn.close(200, "bye".into()).await.unwrap();

        let conn = Connection::connect(&a.amqp_url(), ConnectionProperties::default())
            .await
            .expect("connect to a");
        let ch = conn.create_channel().await.unwrap();
        let mut consumer = ch
            .basic_consume(
                "ha.q".into(),
                "t".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await
            .expect("a delivery on a")
            .expect("consumer open")
            .expect("delivery");
        assert_eq!(delivery.data, b"from b");
        delivery.ack(BasicAckOptions::default()).await.unwrap();
        conn.close(200, "bye".into()).await.unwrap();
    });

    // Joining the cluster it is in is a no-op (by address or member name).
    b.ctl(&["stop_app"]).ok();
    for seed in [a.peers.as_str(), "warren@a"] {
        let out = b.ctl(&["join_cluster", seed]).ok().to_owned();
        assert!(out.contains("already a member"), "{out}");
    }
    b.ctl(&["start_app"]).ok();
    assert_eq!(running_nodes(&b), vec!["warren@a", "warren@b"]);
}

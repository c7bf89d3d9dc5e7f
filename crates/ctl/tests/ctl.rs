//! `warrenctl` and the management HTTP API against a running `warren` node.
//!
//! Every test starts its own node (free ports, its own data directory) and
//! drives it with the real `warrenctl` binary, direct HTTP requests and,
//! for connections and consumers, a real AMQP client (lapin).

mod common;

use std::time::Duration;

use common::{Node, ctl};
use futures::StreamExt as _;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};
use serde_json::{Value, json};
use warren_policy::{Policy, PolicyKind, PolicySpec};

const SEED_DEFINITION: &str = r#"{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"automatic"}"#;

fn node() -> (tempfile::TempDir, Node) {
    let dir = tempfile::tempdir().expect("tempdir");
    let node = Node::start(dir.path());
    (dir, node)
}

/// The validator's own message for a definition (what the CLI and API must show).
fn validator_message(kind: PolicyKind, definition: Value) -> String {
    let spec = PolicySpec::new("/", "p", "^x", definition);
    Policy::new(kind, &spec)
        .expect_err("the definition is invalid")
        .to_string()
}

fn put_queue(n: &Node, name: &str) {
    let (status, _) = n.http(
        "PUT",
        &format!("/api/queues/%2F/{name}"),
        Some(&json!({"durable": true})),
    );
    assert_eq!(status, 201, "PUT queue {name}");
}

fn column<'a>(rows: &'a [Vec<String>], header: &str, row: usize) -> &'a str {
    let i = rows[0]
        .iter()
        .position(|h| h == header)
        .unwrap_or_else(|| panic!("no column {header} in {:?}", rows[0]));
    &rows[row][i]
}

#[test]
fn seed_policy_applies_to_queues_with_mirror_columns() {
    let (_d, n) = node();
    let r = n.ctl(&["set_policy", "hello-ha", "^hello", SEED_DEFINITION]);
    r.ok();
    assert!(r.out.contains("Setting policy \"hello-ha\""), "{r:?}");

    let rows = n.ctl(&["-q", "list_policies"]).rows();
    assert_eq!(
        rows[0],
        [
            "vhost",
            "name",
            "pattern",
            "apply-to",
            "definition",
            "priority"
        ]
    );
    assert_eq!(rows[1][..4], ["/", "hello-ha", "^hello", "all"]);
    let def: Value = serde_json::from_str(&rows[1][4]).unwrap();
    assert_eq!(def, serde_json::from_str::<Value>(SEED_DEFINITION).unwrap());
    assert_eq!(rows[1][5], "0");

    put_queue(&n, "hello.world");
    put_queue(&n, "other");

    let rows = n
        .ctl(&[
            "-q",
            "list_queues",
            "name",
            "messages",
            "pid",
            "slave_pids",
            "synchronised_slave_pids",
            "mirror_pids",
            "synchronised_mirror_pids",
            "state",
            "policy",
            "consumers",
            "messages_ready",
            "messages_unacknowledged",
            "effective_policy_definition",
        ])
        .rows();
    assert_eq!(rows.len(), 3, "{rows:?}");
    assert_eq!(column(&rows, "name", 1), "hello.world");
    assert_eq!(column(&rows, "policy", 1), "hello-ha");
    assert!(column(&rows, "pid", 1).starts_with("<warren@testhost."));
    for c in [
        "slave_pids",
        "synchronised_slave_pids",
        "mirror_pids",
        "synchronised_mirror_pids",
    ] {
        assert_eq!(column(&rows, c, 1), "[]", "{c}");
    }
    assert_eq!(column(&rows, "state", 1), "running");
    assert_eq!(column(&rows, "messages", 1), "0");
    let eff: Value = serde_json::from_str(column(&rows, "effective_policy_definition", 1)).unwrap();
    assert_eq!(eff["ha-mode"], "exactly");
    assert_eq!(column(&rows, "name", 2), "other");
    assert_eq!(column(&rows, "policy", 2), "");

    // The HTTP API shows the same with RabbitMQ's field names.
    let (status, q) = n.http("GET", "/api/queues/%2F/hello.world", None);
    assert_eq!(status, 200);
    assert_eq!(q["node"], "warren@testhost");
    assert_eq!(q["slave_nodes"], json!([]));
    assert_eq!(q["synchronised_slave_nodes"], json!([]));
    assert_eq!(q["state"], "running");
    assert_eq!(q["policy"], "hello-ha");
    assert_eq!(q["effective_policy_definition"]["ha-params"], 2);
    assert_eq!(
        q["effective_policy_definition"]["ha-sync-mode"],
        "automatic"
    );
    for k in [
        "messages",
        "messages_ready",
        "messages_unacknowledged",
        "consumers",
    ] {
        assert_eq!(q[k], 0, "{k}");
    }

    // A mirrored queue without a synchronised mirror is sync-critical.
    let (status, body) = n.http(
        "GET",
        "/api/health/checks/node-is-mirror-sync-critical",
        None,
    );
    assert_eq!(status, 503);
    assert_eq!(body["status"], "failed");
    assert_eq!(
        body["queues"],
        json!([{"name": "hello.world", "vhost": "/"}])
    );

    // sync / cancel_sync are accepted.
    n.ctl(&["sync_queue", "hello.world"]).ok();
    n.ctl(&["cancel_sync_queue", "hello.world"]).ok();
    for action in ["sync", "cancel_sync"] {
        let (status, _) = n.http(
            "POST",
            "/api/queues/%2F/hello.world/actions",
            Some(&json!({"action": action})),
        );
        assert_eq!(status, 204, "{action}");
    }
    let (status, body) = n.http(
        "POST",
        "/api/queues/%2F/hello.world/actions",
        Some(&json!({"action": "explode"})),
    );
    assert_eq!(status, 400);
    assert_eq!(body["error"], "bad_request");
    let r = n.ctl(&["sync_queue", "missing"]);
    assert_eq!(r.code, 65, "{r:?}");

    // Clearing the policy un-mirrors the queue.
    n.ctl(&["clear_policy", "hello-ha"]).ok();
    let rows = n.ctl(&["-q", "list_queues", "name", "policy"]).rows();
    assert_eq!(rows[1], ["hello.world", ""]);
    let (status, _) = n.http(
        "GET",
        "/api/health/checks/node-is-mirror-sync-critical",
        None,
    );
    assert_eq!(status, 200);
    let r = n.ctl(&["clear_policy", "hello-ha"]);
    assert_eq!(r.code, 65, "clearing a missing policy fails: {r:?}");
}

#[test]
fn rejected_policies_show_the_validators_message() {
    let (_d, n) = node();
    let bad = json!({"ha-mode": "exactly"});
    let expected = validator_message(PolicyKind::Regular, bad.clone());

    let r = n.ctl(&["set_policy", "bad", "^x", &bad.to_string()]);
    assert_eq!(r.code, 65, "{r:?}");
    assert!(r.err.contains("Validation failed"), "{r:?}");
    assert!(r.err.contains(&expected), "{expected:?} not in {r:?}");

    let (status, body) = n.http(
        "PUT",
        "/api/policies/%2F/bad",
        Some(&json!({"pattern": "^x", "definition": bad})),
    );
    assert_eq!(status, 400);
    assert_eq!(body["error"], "bad_request");
    assert_eq!(body["reason"], expected.as_str());

    // Not JSON at all.
    let r = n.ctl(&["set_policy", "bad", "^x", "{ha-mode"]);
    assert_eq!(r.code, 65, "{r:?}");
    assert!(r.err.contains("not a valid JSON"), "{r:?}");
    // A bad apply-to and a bad pattern.
    let r = n.ctl(&[
        "set_policy",
        "--apply-to",
        "streams",
        "bad",
        "^x",
        SEED_DEFINITION,
    ]);
    assert_eq!(r.code, 65, "{r:?}");
    let r = n.ctl(&["set_policy", "bad", "(", SEED_DEFINITION]);
    assert_eq!(r.code, 65, "{r:?}");
    // Missing mandatory keys over HTTP.
    let (status, body) = n.http(
        "PUT",
        "/api/policies/%2F/bad",
        Some(&json!({"pattern": "^x"})),
    );
    assert_eq!(status, 400);
    assert!(body["reason"].as_str().unwrap().contains("definition"));

    // An operator policy refuses keys only regular policies may set.
    let op_bad = json!({"alternate-exchange": "x"});
    let expected = validator_message(PolicyKind::Operator, op_bad.clone());
    let r = n.ctl(&["set_operator_policy", "bad", "^x", &op_bad.to_string()]);
    assert_eq!(r.code, 65, "{r:?}");
    assert!(r.err.contains(&expected), "{expected:?} not in {r:?}");

    // Nothing was stored.
    let (_, ps) = n.http("GET", "/api/policies", None);
    assert_eq!(ps, json!([]));
    let (_, ps) = n.http("GET", "/api/operator-policies", None);
    assert_eq!(ps, json!([]));
}

#[test]
fn policy_options_operator_policies_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut n = Node::start(dir.path());
    n.ctl(&["add_vhost", "v1"]).ok();
    n.ctl(&[
        "set_policy",
        "-p",
        "v1",
        "--priority",
        "7",
        "--apply-to",
        "queues",
        "ttl",
        "^t\\.",
        r#"{"message-ttl":1000}"#,
    ])
    .ok();
    n.ctl(&[
        "set_operator_policy",
        "-p",
        "v1",
        "cap",
        ".*",
        r#"{"max-length":10}"#,
    ])
    .ok();
    let (status, p) = n.http("GET", "/api/policies/v1/ttl", None);
    assert_eq!(status, 200);
    assert_eq!(
        p,
        json!({"vhost": "v1", "name": "ttl", "pattern": "^t\\.", "apply-to": "queues",
               "definition": {"message-ttl": 1000}, "priority": 7})
    );
    let rows = n.ctl(&["-q", "-p", "v1", "list_operator_policies"]).rows();
    assert_eq!(rows[1][..4], ["v1", "cap", ".*", "all"]);
    assert_eq!(
        n.ctl(&["-q", "list_policies"]).rows().len(),
        1,
        "only the header in /"
    );

    let (status, _) = n.http("PUT", "/api/queues/v1/t.q", Some(&json!({"durable": true})));
    assert_eq!(status, 201);
    let (_, q) = n.http("GET", "/api/queues/v1/t.q", None);
    assert_eq!(q["policy"], "ttl");
    assert_eq!(q["operator_policy"], "cap");
    assert_eq!(q["effective_policy_definition"]["message-ttl"], 1000);
    assert_eq!(q["effective_policy_definition"]["max-length"], 10);

    // Policies are durable.
    n.terminate();
    drop(n);
    let n = Node::start(dir.path());
    let (_, q) = n.http("GET", "/api/queues/v1/t.q", None);
    assert_eq!(q["policy"], "ttl");
    assert_eq!(q["operator_policy"], "cap");

    n.ctl(&["clear_operator_policy", "-p", "v1", "cap"]).ok();
    let (status, _) = n.http("GET", "/api/operator-policies/v1/cap", None);
    assert_eq!(status, 404);
    // PUT again is an update: 204.
    let (status, _) = n.http(
        "PUT",
        "/api/policies/v1/ttl",
        Some(&json!({"pattern": "^t\\.", "definition": {"message-ttl": 5}, "priority": "3"})),
    );
    assert_eq!(status, 204);
    let (_, p) = n.http("GET", "/api/policies/v1/ttl", None);
    assert_eq!(p["priority"], 3);
    assert_eq!(p["apply-to"], "all");
    let (status, _) = n.http("DELETE", "/api/policies/v1/ttl", None);
    assert_eq!(status, 204);
    let (status, body) = n.http("DELETE", "/api/policies/v1/ttl", None);
    assert_eq!(status, 404);
    assert_eq!(
        body,
        json!({"error": "Object Not Found", "reason": "Not Found"})
    );
}

#[test]
fn vhosts_users_and_permissions() {
    let (_d, n) = node();
    n.ctl(&["add_vhost", "orders"]).ok();
    let rows = n.ctl(&["-q", "list_vhosts"]).rows();
    assert_eq!(rows, [["name"], ["/"], ["orders"]]);
    let (status, _) = n.http("PUT", "/api/vhosts/orders", None);
    assert_eq!(status, 204, "PUT on an existing vhost updates");
    let (status, v) = n.http("GET", "/api/vhosts/%2F", None);
    assert_eq!(status, 200);
    assert_eq!(v["name"], "/");

    n.ctl(&["add_user", "alice", "s3cret"]).ok();
    let r = n.ctl(&["add_user", "alice", "again"]);
    assert_eq!(r.code, 65, "{r:?}");
    // No tags: no management access.
    let (status, body) = n.http_as("alice", "s3cret", "GET", "/api/overview", None);
    assert_eq!(status, 401);
    assert_eq!(body["error"], "not_authorized");
    n.ctl(&["set_user_tags", "alice", "monitoring"]).ok();
    let (status, _) = n.http_as("alice", "s3cret", "GET", "/api/overview", None);
    assert_eq!(status, 200);
    let (_, me) = n.http_as("alice", "s3cret", "GET", "/api/whoami", None);
    assert_eq!(me, json!({"name": "alice", "tags": ["monitoring"]}));
    // Monitoring may read, not change.
    let (status, body) = n.http_as("alice", "s3cret", "PUT", "/api/vhosts/x", None);
    assert_eq!(status, 401);
    assert_eq!(body["reason"], "Not administrator user");
    // Wrong password.
    let (status, _) = n.http_as("alice", "wrong", "GET", "/api/overview", None);
    assert_eq!(status, 401);

    n.ctl(&["change_password", "alice", "n3w"]).ok();
    let (status, _) = n.http_as("alice", "s3cret", "GET", "/api/overview", None);
    assert_eq!(status, 401);
    let (status, _) = n.http_as("alice", "n3w", "GET", "/api/overview", None);
    assert_eq!(status, 200);
    // Tags survive a password change.
    let rows = n.ctl(&["-q", "list_users"]).rows();
    assert_eq!(rows[0], ["user", "tags"]);
    assert!(rows.contains(&vec!["alice".to_owned(), "[monitoring]".to_owned()]));
    assert!(rows.contains(&vec!["guest".to_owned(), "[administrator]".to_owned()]));
    // The CLI works as that user too.
    let r = ctl(&[
        "--node",
        &n.http,
        "--username",
        "alice",
        "--password",
        "n3w",
        "-q",
        "list_vhosts",
    ]);
    r.ok();
    let r = ctl(&[
        "--node",
        &n.http,
        "--username",
        "alice",
        "--password",
        "nope",
        "list_vhosts",
    ]);
    assert_eq!(r.code, 64, "{r:?}");
    assert!(r.err.contains("not authorised"), "{r:?}");

    n.ctl(&[
        "set_permissions",
        "-p",
        "orders",
        "alice",
        "^a-.*",
        ".*",
        ".*",
    ])
    .ok();
    let rows = n.ctl(&["-q", "-p", "orders", "list_permissions"]).rows();
    assert_eq!(
        rows,
        [
            vec!["user", "configure", "write", "read"],
            vec!["alice", "^a-.*", ".*", ".*"]
        ]
    );
    let rows = n.ctl(&["-q", "list_user_permissions", "alice"]).rows();
    assert_eq!(rows[1], ["orders", "^a-.*", ".*", ".*"]);
    let (status, p) = n.http("GET", "/api/permissions/orders/alice", None);
    assert_eq!(status, 200);
    assert_eq!(p["configure"], "^a-.*");
    let (status, body) = n.http(
        "PUT",
        "/api/permissions/orders/alice",
        Some(&json!({"configure": ".*"})),
    );
    assert_eq!(status, 400);
    assert!(body["reason"].as_str().unwrap().contains("write"));
    n.ctl(&["clear_permissions", "-p", "orders", "alice"]).ok();
    let (status, _) = n.http("GET", "/api/permissions/orders/alice", None);
    assert_eq!(status, 404);

    n.ctl(&["delete_user", "alice"]).ok();
    let (status, _) = n.http("GET", "/api/users/alice", None);
    assert_eq!(status, 404);
    n.ctl(&["delete_vhost", "orders"]).ok();
    let (status, _) = n.http("GET", "/api/vhosts/orders", None);
    assert_eq!(status, 404);
    let r = n.ctl(&["delete_vhost", "orders"]);
    assert_eq!(r.code, 65, "{r:?}");
    assert!(r.err.contains("not found"), "{r:?}");
}

#[test]
fn queues_exchanges_bindings_connections_consumers() {
    let (_d, n) = node();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = n.amqp_url();
    let (conn, consumer_ch, mut consumer) = rt.block_on(async {
        let conn = Connection::connect(&url, ConnectionProperties::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.exchange_declare(
            "orders".into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        ch.queue_declare(
            "work".into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        ch.queue_bind(
            "work".into(),
            "orders".into(),
            "order.*".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        for i in 0..3 {
            ch.basic_publish(
                "orders".into(),
                "order.new".into(),
                BasicPublishOptions::default(),
                format!("m{i}").as_bytes(),
                BasicProperties::default(),
            )
            .await
            .unwrap();
        }
        assert!(ch.wait_for_confirms().await.unwrap().is_empty());
        let cch = conn.create_channel().await.unwrap();
        cch.basic_qos(1, BasicQosOptions::default()).await.unwrap();
        let mut consumer = cch
            .basic_consume(
                "work".into(),
                "worker-1".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        // One delivery in flight (prefetch 1): 2 ready, 1 unacked.
        let first = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await
            .expect("a delivery")
            .expect("a delivery")
            .unwrap();
        assert_eq!(first.data, b"m0");
        (conn, cch, consumer)
    });

    let rows = n
        .ctl(&[
            "-q",
            "list_queues",
            "name",
            "messages",
            "messages_ready",
            "messages_unacknowledged",
            "consumers",
            "durable",
        ])
        .rows();
    assert_eq!(rows[1], ["work", "3", "2", "1", "1", "true"]);
    // Default columns: name messages; the banner without -q.
    let r = n.ctl(&["list_queues"]);
    assert_eq!(
        r.ok(),
        "Listing queues for vhost / ...\nname\tmessages\nwork\t3\n"
    );
    let r = n.ctl(&["-s", "list_queues"]);
    assert_eq!(r.ok(), "work\t3\n");
    let r = n.ctl(&["--formatter", "json", "list_queues", "name", "consumers"]);
    let v: Value = serde_json::from_str(r.ok()).unwrap();
    assert_eq!(v, json!([{"name": "work", "consumers": 1}]));
    let r = n.ctl(&["list_queues", "name", "colour"]);
    assert_eq!(r.code, 64, "{r:?}");
    assert!(
        r.err.contains("colour") && r.err.contains("slave_pids"),
        "{r:?}"
    );

    let rows = n.ctl(&["-q", "list_exchanges"]).rows();
    assert_eq!(rows[0], ["name", "type"]);
    assert!(rows.contains(&vec!["orders".to_owned(), "topic".to_owned()]));
    assert!(rows.contains(&vec![String::new(), "direct".to_owned()]));
    let (status, x) = n.http("GET", "/api/exchanges/%2F/orders", None);
    assert_eq!(status, 200);
    assert_eq!(x["type"], "topic");
    assert_eq!(x["durable"], true);

    let rows = n.ctl(&["-q", "list_bindings"]).rows();
    assert_eq!(
        rows[0],
        [
            "source_name",
            "source_kind",
            "destination_name",
            "destination_kind",
            "routing_key",
            "arguments"
        ]
    );
    assert!(rows.contains(&vec![
        "orders".to_owned(),
        "exchange".to_owned(),
        "work".to_owned(),
        "queue".to_owned(),
        "order.*".to_owned(),
        "{}".to_owned()
    ]));
    let (_, bs) = n.http("GET", "/api/bindings/%2F", None);
    assert!(
        bs.as_array()
            .unwrap()
            .iter()
            .any(|b| b["source"] == "orders"
                && b["destination"] == "work"
                && b["routing_key"] == "order.*")
    );

    let rows = n.ctl(&["-q", "list_connections"]).rows();
    assert_eq!(rows[0], ["user", "peer_host", "peer_port", "state"]);
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1][0], "guest");
    assert_eq!(rows[1][1], "127.0.0.1");
    assert_eq!(rows[1][3], "running");
    let (_, cs) = n.http("GET", "/api/connections", None);
    assert_eq!(cs[0]["vhost"], "/");
    assert_eq!(cs[0]["channels"], 2);

    let rows = n.ctl(&["-q", "list_consumers"]).rows();
    assert_eq!(
        rows[0],
        [
            "queue_name",
            "channel_pid",
            "consumer_tag",
            "ack_required",
            "prefetch_count",
            "active",
            "arguments"
        ]
    );
    assert_eq!(column(&rows, "queue_name", 1), "work");
    assert_eq!(column(&rows, "consumer_tag", 1), "worker-1");
    assert_eq!(column(&rows, "ack_required", 1), "true");
    assert_eq!(column(&rows, "prefetch_count", 1), "1");
    let (_, cs) = n.http("GET", "/api/consumers", None);
    assert_eq!(cs[0]["queue"], json!({"name": "work", "vhost": "/"}));
    let (_, o) = n.http("GET", "/api/overview", None);
    assert_eq!(o["object_totals"]["connections"], 1);
    assert_eq!(o["object_totals"]["consumers"], 1);
    assert_eq!(o["queue_totals"]["messages"], 3);

    // The digest of this node's copy: the same while nothing changes,
    // another once the queue does.
    let digest = |n: &Node| n.ctl(&["-q", "queue_digest", "work"]).rows()[1][0].clone();
    let before = digest(&n);
    assert_eq!(before.len(), 16, "{before:?}");
    assert_eq!(digest(&n), before);

    // Purge drops the ready messages, not the unacked one.
    n.ctl(&["purge_queue", "work"]).ok();
    assert_ne!(digest(&n), before, "the digest follows the queue's content");
    let rows = n
        .ctl(&[
            "-q",
            "list_queues",
            "name",
            "messages_ready",
            "messages_unacknowledged",
        ])
        .rows();
    assert_eq!(rows[1], ["work", "0", "1"]);
    let (status, _) = n.http("DELETE", "/api/queues/%2F/work/contents", None);
    assert_eq!(status, 204);

    // delete_queue --if-unused refuses while the consumer is there.
    let r = n.ctl(&["delete_queue", "--if-unused", "work"]);
    assert_eq!(r.code, 65, "{r:?}");
    n.ctl(&["delete_queue", "work"]).ok();
    let rows = n.ctl(&["-q", "list_queues"]).rows();
    assert_eq!(rows.len(), 1, "{rows:?}");
    let (status, _) = n.http("DELETE", "/api/queues/%2F/work", None);
    assert_eq!(status, 404);
    rt.block_on(async {
        // The consumer was cancelled by the deletion; the connection is still fine.
        drop(consumer_ch);
        let _ = tokio::time::timeout(Duration::from_secs(30), consumer.next()).await;
        conn.close(200, "bye".into()).await.unwrap();
    });
}

#[test]
fn definitions_export_and_import() {
    let (_d, a) = node();
    a.ctl(&["add_vhost", "shop"]).ok();
    a.ctl(&["add_user", "bob", "pw"]).ok();
    a.ctl(&["set_user_tags", "bob", "management"]).ok();
    a.ctl(&["set_permissions", "-p", "shop", "bob", ".*", ".*", ".*"])
        .ok();
    a.ctl(&["set_policy", "hello-ha", "^hello", SEED_DEFINITION])
        .ok();
    put_queue(&a, "hello");
    let (status, _) = a.http(
        "POST",
        "/api/definitions",
        Some(&json!({
            "exchanges": [{"name": "ex", "vhost": "/", "type": "fanout", "durable": true,
                           "auto_delete": false, "internal": false, "arguments": {}}],
            "bindings": [{"source": "ex", "vhost": "/", "destination": "hello",
                          "destination_type": "queue", "routing_key": "", "arguments": {}}],
        })),
    );
    assert_eq!(status, 204);
    let file = tempfile::NamedTempFile::new().unwrap();
    let path = file.path().to_str().unwrap();
    a.ctl(&["export_definitions", path]).ok();
    let defs: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert!(
        defs["users"]
            .as_array()
            .unwrap()
            .iter()
            .any(|u| u["name"] == "bob"
                && u["hashing_algorithm"] == "rabbit_password_hashing_sha256")
    );
    assert!(
        defs["vhosts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["name"] == "shop")
    );
    assert_eq!(defs["policies"][0]["name"], "hello-ha");
    assert_eq!(defs["policies"][0]["apply-to"], "all");
    assert_eq!(defs["queues"][0]["name"], "hello");
    assert_eq!(defs["exchanges"][0]["name"], "ex");
    assert_eq!(defs["bindings"][0]["source"], "ex");

    let (_d2, b) = node();
    b.ctl(&["import_definitions", path]).ok();
    let (status, q) = b.http("GET", "/api/queues/%2F/hello", None);
    assert_eq!(status, 200);
    assert_eq!(q["policy"], "hello-ha");
    let (status, _) = b.http_as("bob", "pw", "GET", "/api/overview", None);
    assert_eq!(status, 200, "bob's password hash came along");
    let (status, _) = b.http("GET", "/api/permissions/shop/bob", None);
    assert_eq!(status, 200);
    let (_, bs) = b.http("GET", "/api/bindings/%2F", None);
    assert!(bs.as_array().unwrap().iter().any(|x| x["source"] == "ex"));
    // Exporting again gives the same definitions.
    let (_, again) = b.http("GET", "/api/definitions", None);
    for k in ["policies", "queues", "exchanges", "bindings", "vhosts"] {
        assert_eq!(again[k], defs[k], "{k}");
    }

    // A definitions file with a bad policy changes nothing and says why.
    let bad = json!({
        "vhosts": [{"name": "never"}],
        "policies": [{"vhost": "/", "name": "p", "pattern": "^x", "apply-to": "all",
                      "definition": {"ha-mode": "exactly"}, "priority": 0}],
    });
    let bad_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(bad_file.path(), bad.to_string()).unwrap();
    let r = b.ctl(&["import_definitions", bad_file.path().to_str().unwrap()]);
    assert_eq!(r.code, 65, "{r:?}");
    let expected = validator_message(PolicyKind::Regular, json!({"ha-mode": "exactly"}));
    assert!(r.err.contains(&expected), "{expected:?} not in {r:?}");
    let (status, _) = b.http("GET", "/api/vhosts/never", None);
    assert_eq!(status, 404);
    // Not JSON.
    std::fs::write(bad_file.path(), "{").unwrap();
    let r = b.ctl(&["import_definitions", bad_file.path().to_str().unwrap()]);
    assert_eq!(r.code, 65, "{r:?}");
}

#[test]
fn status_cluster_status_and_unsupported_verbs() {
    let (_d, n) = node();
    let out = n.ctl(&["status"]).ok().to_owned();
    assert!(
        out.starts_with("Status of node warren@testhost ..."),
        "{out}"
    );
    assert!(
        out.contains(&format!("port: {}, protocol: amqp", n.amqp_port)),
        "{out}"
    );
    let out = n.ctl(&["cluster_status"]).ok().to_owned();
    for section in [
        "Basics",
        "Disk Nodes",
        "Running Nodes",
        "Versions",
        "Maintenance status",
        "Alarms",
        "Network Partitions",
        "Listeners",
        "Feature flags",
    ] {
        assert!(
            out.contains(&format!("\n{section}\n")),
            "{section} in {out}"
        );
    }
    assert!(out.contains("\nwarren@testhost\n"), "{out}");
    let v: Value =
        serde_json::from_str(n.ctl(&["--formatter", "json", "cluster_status"]).ok()).unwrap();
    assert_eq!(v["running_nodes"], json!(["warren@testhost"]));
    let v: Value = serde_json::from_str(n.ctl(&["--formatter", "json", "status"]).ok()).unwrap();
    assert_eq!(v["node"], "warren@testhost");

    // A node running alone (no --peer-addr) cannot join a cluster.
    let r = n.ctl(&["join_cluster", "127.0.0.1:25672"]);
    assert_eq!(r.code, 69, "{r:?}");
    assert!(
        r.err.contains("runs alone") && r.err.contains("--peer-addr"),
        "{r:?}"
    );
    let r = n.ctl(&["forget_cluster_node", "warren@other"]);
    assert_eq!(r.code, 69, "{r:?}");
    assert!(r.err.contains("not supported by this node yet"), "{r:?}");
    // The offline form edits a stopped node's data directory (tests/offline.rs)
    // and says what it needs when called without it.
    let r = n.ctl(&["forget_cluster_node", "--offline", "warren@other"]);
    assert_eq!(r.code, 64, "{r:?}");
    assert!(r.err.contains("--data-dir"), "{r:?}");
}

#[test]
fn resource_limits_alarms_status_and_metrics() {
    let (_d, n) = node();
    let node_json = || n.http("GET", "/api/nodes/warren%40testhost", None).1;
    // RabbitMQ's defaults: 0.4 of the machine's memory, 50 MB of disk.
    assert_eq!(node_json()["disk_free_limit"], 50_000_000);
    assert!(node_json()["mem_limit"].as_u64().unwrap() > 0);
    let out = n.ctl(&["status"]).ok().to_owned();
    assert!(out.contains("\nAlarms\n\n(none)\n"), "{out}");

    n.ctl(&["set_vm_memory_high_watermark", "absolute", "1"])
        .ok();
    assert_eq!(node_json()["mem_alarm"], true);
    assert_eq!(node_json()["mem_limit"], 1);
    let out = n.ctl(&["status"]).ok().to_owned();
    assert!(
        out.contains("Memory alarm on node warren@testhost"),
        "{out}"
    );
    let out = n.ctl(&["cluster_status"]).ok().to_owned();
    assert!(
        out.contains("Memory alarm on node warren@testhost"),
        "{out}"
    );
    let (_, _, text) = n.get_plain(&n.metrics, "/metrics");
    for line in [
        "rabbitmq_alarms_memory_used_watermark 1",
        "rabbitmq_alarms_free_disk_space_watermark 0",
        "rabbitmq_resident_memory_limit_bytes 1",
        "rabbitmq_disk_space_available_limit_bytes 50000000",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "{line:?} missing from\n{text}"
        );
    }

    n.ctl(&["set_vm_memory_high_watermark", "0.9"]).ok();
    assert_eq!(node_json()["mem_alarm"], false);
    n.ctl(&["set_disk_free_limit", "mem_relative", "1000000"])
        .ok();
    assert_eq!(node_json()["disk_free_alarm"], true);
    let out = n.ctl(&["cluster_status"]).ok().to_owned();
    assert!(
        out.contains("Free disk space alarm on node warren@testhost"),
        "{out}"
    );
    n.ctl(&["set_disk_free_limit", "50MB"]).ok();
    assert_eq!(node_json()["disk_free_alarm"], false);
    assert_eq!(node_json()["disk_free_limit"], 50_000_000);

    // Bad values: the node's reason, or the usage, and a non-zero exit.
    let r = n.ctl(&["set_disk_free_limit", "plenty"]);
    assert_ne!(r.code, 0, "{r:?}");
    assert!(r.err.contains("is not a size"), "{r:?}");
    let r = n.ctl(&["set_vm_memory_high_watermark", "lots"]);
    assert_eq!(r.code, 64, "{r:?}");
    let r = n.ctl(&["set_vm_memory_high_watermark", "relative", "0.5"]);
    assert_eq!(r.code, 64, "{r:?}");
}

#[test]
fn message_counters_and_confirm_latency() {
    let (_d, n) = node();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = n.amqp_url();
    let _conn = rt.block_on(async {
        let conn = Connection::connect(&url, ConnectionProperties::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        ch.queue_declare("counted".into(), durable, FieldTable::default())
            .await
            .unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        // Four persistent messages into the queue, one unroutable and returned.
        for (key, mandatory) in [("counted", false); 4]
            .into_iter()
            .chain([("nowhere", true)])
        {
            ch.basic_publish(
                "".into(),
                key.into(),
                BasicPublishOptions {
                    mandatory,
                    ..Default::default()
                },
                b"x",
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap();
        }
        ch.wait_for_confirms().await.unwrap();
        for _ in 0..4 {
            let m = ch
                .basic_get("counted".into(), BasicGetOptions::default())
                .await
                .unwrap()
                .expect("a message");
            m.ack(BasicAckOptions::default()).await.unwrap();
        }
        let empty = ch
            .basic_get("counted".into(), BasicGetOptions::default())
            .await
            .unwrap();
        assert!(empty.is_none());
        conn
    });
    let want = [
        "rabbitmq_global_messages_received_total{protocol=\"amqp091\"} 5",
        "rabbitmq_global_messages_received_confirm_total{protocol=\"amqp091\"} 5",
        "rabbitmq_global_messages_routed_total{protocol=\"amqp091\"} 4",
        "rabbitmq_global_messages_unroutable_returned_total{protocol=\"amqp091\"} 1",
        "rabbitmq_global_messages_confirmed_total{protocol=\"amqp091\"} 5",
        "rabbitmq_global_messages_delivered_total{protocol=\"amqp091\"} 4",
        "rabbitmq_global_messages_acknowledged_total{protocol=\"amqp091\"} 4",
        "rabbitmq_global_messages_get_empty_total{protocol=\"amqp091\"} 1",
        "rabbitmq_queue_messages_published_total{vhost=\"/\",queue=\"counted\"} 4",
        "rabbitmq_queue_messages_delivered_total{vhost=\"/\",queue=\"counted\"} 4",
        "rabbitmq_queue_messages_acked_total{vhost=\"/\",queue=\"counted\"} 4",
        "warren_confirm_latency_seconds_bucket{le=\"+Inf\"} 5",
        "warren_confirm_latency_seconds_count 5",
        "# TYPE warren_confirm_latency_seconds histogram",
    ];
    // The acks are asynchronous: wait until the node has counted them.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let text = loop {
        let (_, _, text) = n.get_plain(&n.metrics, "/metrics");
        if want.iter().all(|w| text.lines().any(|l| l == *w)) {
            break text;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "missing {:?} in\n{text}",
            want.iter().find(|w| !text.lines().any(|l| l == **w))
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        !text.contains("warren_queue_ring_view{"),
        "an unmirrored queue has no ring:\n{text}"
    );
    let (_, q) = n.http("GET", "/api/queues/%2F/counted", None);
    for (field, n) in [
        ("publish", 4),
        ("deliver_get", 4),
        ("redeliver", 0),
        ("ack", 4),
    ] {
        assert_eq!(q["message_stats"][field], n, "{q}");
        assert!(
            q["message_stats"][format!("{field}_details")]["rate"].is_f64(),
            "{q}"
        );
    }
    let (_, o) = n.http("GET", "/api/overview", None);
    assert_eq!(o["message_stats"]["publish"], 5, "{o}");
    assert_eq!(o["message_stats"]["confirm"], 5, "{o}");
    assert_eq!(o["message_stats"]["return_unroutable"], 1, "{o}");
}

#[test]
fn stop_app_start_app_and_stop() {
    let (_d, mut n) = node();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = n.amqp_url();
    let connect = || rt.block_on(Connection::connect(&url, ConnectionProperties::default()));
    let conn = connect().expect("connect while the app runs");
    assert!(n.ctl(&["status"]).ok().contains("\nApplication: running\n"));

    let r = n.ctl(&["stop_app"]);
    assert!(
        r.ok()
            .contains("Stopping rabbit application on node warren@testhost ..."),
        "{r:?}"
    );
    // The open connection is closed by the broker (320 CONNECTION_FORCED).
    let closed = rt.block_on(async {
        for _ in 0..100 {
            if !conn.status().connected() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    });
    assert!(closed, "stop_app closes client connections");
    let refused = std::net::TcpStream::connect(("127.0.0.1", n.amqp_port))
        .expect_err("the AMQP listener is closed");
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
    assert!(connect().is_err(), "an AMQP client is refused");
    // The node and its API keep running.
    assert!(n.ctl(&["status"]).ok().contains("\nApplication: stopped"));
    let v: Value = serde_json::from_str(n.ctl(&["--formatter", "json", "status"]).ok()).unwrap();
    assert_eq!(v["app_running"], false);
    n.ctl(&["stop_app"]).ok();

    let r = n.ctl(&["start_app"]);
    assert!(
        r.ok().contains("Starting node warren@testhost ..."),
        "{r:?}"
    );
    let conn = connect().expect("connect after start_app");
    rt.block_on(conn.close(200, "bye".into())).unwrap();
    let v: Value = serde_json::from_str(n.ctl(&["--formatter", "json", "status"]).ok()).unwrap();
    assert_eq!(v["app_running"], true);
    n.ctl(&["start_app"]).ok();

    // Administrators only.
    let (status, _) = n.http(
        "PUT",
        "/api/users/watcher",
        Some(&json!({"password": "w", "tags": "monitoring"})),
    );
    assert_eq!(status, 201);
    let r = n.ctl(&["--username", "watcher", "--password", "w", "stop_app"]);
    assert_eq!(r.code, 64, "{r:?}");
    // Another node's name is not found.
    let (status, _) = n.http("POST", "/api/nodes/warren@other/stop_app", None);
    assert_eq!(status, 404);

    let r = n.ctl(&["stop"]);
    assert!(
        r.ok()
            .contains("Stopping and halting node warren@testhost ..."),
        "{r:?}"
    );
    let status = n
        .wait_exit(Duration::from_secs(30))
        .expect("the node exits after stop");
    assert!(status.success(), "{status:?}");
}

#[test]
fn unknown_node_is_a_clear_error() {
    // Port 1 on loopback: nothing listens there.
    let r = ctl(&["--node", "127.0.0.1:1", "list_queues"]);
    assert_eq!(r.code, 69, "{r:?}");
    assert!(r.err.contains("could not reach node 127.0.0.1:1"), "{r:?}");
    let r = ctl(&["no_such_verb"]);
    assert_eq!(r.code, 64, "{r:?}");
}

#[test]
fn http_api_conventions() {
    let (_d, n) = node();
    // No credentials: 401 with RabbitMQ's error body and a challenge.
    let agent = ureq::AgentBuilder::new().build();
    match agent.get(&format!("http://{}/api/overview", n.http)).call() {
        Err(ureq::Error::Status(401, r)) => {
            assert!(r.header("www-authenticate").is_some());
            let v: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
            assert_eq!(v["error"], "not_authorized");
        }
        other => panic!("expected 401, got {other:?}"),
    }
    let (status, o) = n.http("GET", "/api/overview", None);
    assert_eq!(status, 200);
    for k in [
        "management_version",
        "rabbitmq_version",
        "product_name",
        "cluster_name",
        "node",
        "listeners",
        "object_totals",
        "queue_totals",
    ] {
        assert!(o.get(k).is_some(), "overview lacks {k}");
    }
    assert_eq!(o["node"], "warren@testhost");
    let (status, nodes) = n.http("GET", "/api/nodes", None);
    assert_eq!(status, 200);
    assert_eq!(nodes[0]["name"], "warren@testhost");
    assert_eq!(nodes[0]["running"], true);
    assert_eq!(nodes[0]["type"], "disc");
    let (status, _) = n.http("GET", "/api/nodes/warren@testhost", None);
    assert_eq!(status, 200);
    let (status, _) = n.http("GET", "/api/nodes/nobody", None);
    assert_eq!(status, 404);
    for check in [
        "alarms",
        "local-alarms",
        "virtual-hosts",
        "node-is-mirror-sync-critical",
    ] {
        let (status, v) = n.http("GET", &format!("/api/health/checks/{check}"), None);
        assert_eq!(status, 200, "{check}");
        assert_eq!(v["status"], "ok");
    }
    // Unknown vhost, unknown path, bad JSON.
    let (status, _) = n.http("GET", "/api/queues/nope", None);
    assert_eq!(status, 404);
    let (status, v) = n.http("GET", "/api/no-such-thing", None);
    assert_eq!(status, 404);
    assert_eq!(v["error"], "Object Not Found");
    let agent = ureq::AgentBuilder::new().build();
    let r = agent
        .put(&format!("http://{}/api/vhosts/x", n.http))
        .set("Authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=")
        .set("Content-Type", "application/json")
        .send_string("{not json");
    match r {
        Err(ureq::Error::Status(400, r)) => {
            let v: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
            assert_eq!(v["error"], "bad_request");
        }
        other => panic!("expected 400, got {other:?}"),
    }

    // Pagination of queues.
    for q in ["q1", "q2", "q3"] {
        put_queue(&n, q);
    }
    let (_, page) = n.http("GET", "/api/queues/%2F?page=2&page_size=2", None);
    assert_eq!(page["page"], 2);
    assert_eq!(page["page_count"], 2);
    assert_eq!(page["total_count"], 3);
    assert_eq!(page["items"][0]["name"], "q3");
    let (_, filtered) = n.http("GET", "/api/queues?name=q2", None);
    assert_eq!(filtered.as_array().unwrap().len(), 1);

    // The OpenAPI document lists every endpoint served, and needs no auth.
    let r = agent
        .get(&format!("http://{}/api/openapi.json", n.http))
        .call()
        .unwrap();
    let doc: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
    assert_eq!(doc["openapi"], "3.0.3");
    let paths = doc["paths"].as_object().unwrap();
    for p in [
        "/api/overview",
        "/api/nodes",
        "/api/vhosts/{vhost}",
        "/api/users/{name}",
        "/api/permissions/{vhost}/{user}",
        "/api/policies/{vhost}/{name}",
        "/api/operator-policies/{vhost}/{name}",
        "/api/queues/{vhost}/{name}",
        "/api/queues/{vhost}/{name}/contents",
        "/api/queues/{vhost}/{name}/actions",
        "/api/exchanges",
        "/api/bindings",
        "/api/connections",
        "/api/consumers",
        "/api/definitions",
        "/api/health/checks/node-is-mirror-sync-critical",
    ] {
        assert!(
            paths.contains_key(p),
            "{p} missing from the OpenAPI document"
        );
    }
    assert!(paths["/api/policies/{vhost}/{name}"]["put"].is_object());

    // Users over HTTP: 201 on create, password_hash accepted, 204 on delete.
    let (status, _) = n.http(
        "PUT",
        "/api/users/carol",
        Some(&json!({"password": "pw", "tags": "administrator"})),
    );
    assert_eq!(status, 201);
    let (status, _) = n.http_as("carol", "pw", "PUT", "/api/vhosts/c", None);
    assert_eq!(status, 201);
    let (status, _) = n.http("DELETE", "/api/vhosts/c", None);
    assert_eq!(status, 204);
    let (status, _) = n.http("DELETE", "/api/users/carol", None);
    assert_eq!(status, 204);
}

#[test]
fn web_page_and_prometheus_metrics() {
    let (_d, n) = node();
    let (status, ctype, html) = n.get_plain(&n.http, "/");
    assert_eq!(status, 200);
    assert!(ctype.starts_with("text/html"), "{ctype}");
    // The pages and the policy form the seed starts from.
    for needle in [
        "Overview",
        "Queues",
        "Admin &rarr; Policies",
        "Add / update a policy",
        "id=\"p-name\"",
        "id=\"p-pattern\"",
        "id=\"p-apply\"",
        "id=\"p-priority\"",
        "def-rows",
        "HA mode",
        "HA params",
        "HA sync mode",
        "policy-error",
        "Synchronise",
        "(unsynchronised)",
        "ringSvg",
        "mirrorsBadge",
    ] {
        assert!(html.contains(needle), "{needle} missing from the page");
    }

    n.ctl(&["set_policy", "hello-ha", "^hello", SEED_DEFINITION])
        .ok();
    put_queue(&n, "hello");
    let (status, ctype, text) = n.get_plain(&n.metrics, "/metrics");
    assert_eq!(status, 200);
    assert!(ctype.starts_with("text/plain"), "{ctype}");
    for line in [
        "# TYPE rabbitmq_queue_messages_ready gauge",
        "rabbitmq_queue_messages_ready{vhost=\"/\",queue=\"hello\"} 0",
        "rabbitmq_queue_messages_unacked{vhost=\"/\",queue=\"hello\"} 0",
        "rabbitmq_queue_consumers{vhost=\"/\",queue=\"hello\"} 0",
        "rabbitmq_queues 1",
        "rabbitmq_connections 0",
        "rabbitmq_process_open_tcp_sockets 0",
        "# TYPE rabbitmq_process_max_tcp_sockets gauge",
        "# TYPE rabbitmq_process_max_fds gauge",
        "warren_queue_ring_members{vhost=\"/\",queue=\"hello\"} 1",
        "warren_queue_synchronised_mirrors{vhost=\"/\",queue=\"hello\"} 0",
        "rabbitmq_identity_info{rabbitmq_node=\"warren@testhost\",rabbitmq_cluster=\"warren@testhost\"} 1",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "{line:?} missing from\n{text}"
        );
    }
}

#[test]
fn exchanges_and_bindings_over_http() {
    let (_d, n) = node();
    let (status, _) = n.http(
        "PUT",
        "/api/exchanges/%2F/events",
        Some(&json!({"type": "fanout", "durable": true})),
    );
    assert_eq!(status, 201);
    let (status, _) = n.http(
        "PUT",
        "/api/exchanges/%2F/events",
        Some(&json!({"type": "fanout"})),
    );
    assert_eq!(status, 204);
    let (status, body) = n.http(
        "PUT",
        "/api/exchanges/%2F/bad",
        Some(&json!({"type": "nope"})),
    );
    assert_eq!(status, 400);
    assert!(body["reason"].as_str().unwrap().contains("nope"), "{body}");
    put_queue(&n, "audit");
    let (status, _) = n.http(
        "POST",
        "/api/bindings/%2F/e/events/q/audit",
        Some(&json!({"routing_key": "k", "arguments": {}})),
    );
    assert_eq!(status, 201);
    let (status, bs) = n.http("GET", "/api/bindings/%2F/e/events/q/audit", None);
    assert_eq!(status, 200);
    assert_eq!(bs[0]["routing_key"], "k");
    assert_eq!(bs[0]["destination_type"], "queue");
    let rows = n
        .ctl(&[
            "-q",
            "list_bindings",
            "source_name",
            "destination_name",
            "routing_key",
        ])
        .rows();
    assert!(rows.contains(&vec![
        "events".to_owned(),
        "audit".to_owned(),
        "k".to_owned()
    ]));
    let (status, _) = n.http(
        "POST",
        "/api/bindings/%2F/e/events/q/missing",
        Some(&json!({"routing_key": ""})),
    );
    assert_eq!(status, 400);

    let (status, _) = n.http("DELETE", "/api/exchanges/%2F/amq.direct", None);
    assert_eq!(status, 400);
    let (status, _) = n.http("DELETE", "/api/exchanges/%2F/events", None);
    assert_eq!(status, 204);
    let (status, _) = n.http("DELETE", "/api/exchanges/%2F/events", None);
    assert_eq!(status, 404);
    let (_, bs) = n.http("GET", "/api/bindings/%2F", None);
    assert!(
        !bs.as_array()
            .unwrap()
            .iter()
            .any(|b| b["source"] == "events")
    );
}

#[test]
fn close_connection_over_ctl_and_http() {
    let (_d, n) = node();
    let rt = tokio::runtime::Runtime::new().unwrap();
    // The connection and the error lapin reports when the server closes it.
    let connect = || {
        let conn = rt
            .block_on(Connection::connect(
                &n.amqp_url(),
                ConnectionProperties::default(),
            ))
            .expect("connect");
        let error = std::sync::Arc::new(std::sync::Mutex::new(None::<String>));
        let slot = error.clone();
        let mut events = Box::pin(conn.events_listener());
        rt.spawn(async move {
            while let Some(e) = events.next().await {
                if let lapin::Event::Error(e) = e {
                    *slot.lock().unwrap() = Some(e.to_string());
                }
            }
        });
        (conn, error)
    };
    let name_of_only = || {
        let rows = n.ctl(&["-q", "list_connections", "name"]).rows();
        assert_eq!(rows.len(), 2, "one connection: {rows:?}");
        rows[1][0].clone()
    };
    // warrenctl close_connection NAME EXPLANATION: the client reads 320
    // CONNECTION_FORCED with the explanation.
    let conn = connect();
    let name = name_of_only();
    n.ctl(&["close_connection", &name, "go away"]).ok();
    let closed =
        |(_conn, error): &(Connection, std::sync::Arc<std::sync::Mutex<Option<String>>>)| {
            rt.block_on(async {
                for _ in 0..300 {
                    if let Some(e) = error.lock().unwrap().clone() {
                        return e;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                panic!("the connection was not closed");
            })
        };
    let text = closed(&conn);
    assert!(
        text.contains("320") || text.contains("CONNECTION_FORCED"),
        "{text}"
    );
    assert!(text.contains("go away"), "{text}");
    // DELETE /api/connections/NAME with X-Reason, as RabbitMQ's API.
    let conn = connect();
    let name = name_of_only();
    let path = format!(
        "/api/connections/{}",
        name.replace(' ', "%20").replace('>', "%3E")
    );
    let (status, v) = n.http("GET", &path, None);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["name"], name.as_str());
    let (status, _) = n.http("DELETE", &path, None);
    assert_eq!(status, 204);
    let text = closed(&conn);
    assert!(text.contains("Closed via management plugin"), "{text}");
    let (status, _) = n.http("DELETE", &path, None);
    assert_eq!(status, 404, "already gone");
    let r = n.ctl(&["close_connection", "127.0.0.1:1 -> nowhere", "x"]);
    assert_ne!(r.code, 0, "an unknown connection is an error: {r:?}");
}

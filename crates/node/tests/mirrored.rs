//! Mirrored queues across `warren` processes on 127.0.0.1: a queue matched
//! by an `ha-mode: all` policy gets synchronised mirrors on the other nodes,
//! and when its master's node is SIGKILLed under confirmed publishing, the
//! oldest synchronised mirror takes over with every confirmed message.

mod peers;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt as _;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions,
    BasicQosOptions, BasicRejectOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, Consumer};
use peers::{Peer, declare_durable, eventually, names, set_ha_all, three, three_with};
use serde_json::{Value, json};

const QUEUE: &str = "ha.orders";

fn queue(p: &Peer) -> Value {
    queue_named(p, QUEUE)
}

/// Queue `name` as `p`'s management API shows it (null if it has none).
fn queue_named(p: &Peer, name: &str) -> Value {
    let (status, v) = p.http("GET", &format!("/api/queues/%2F/{name}"), None);
    if status == 200 { v } else { Value::Null }
}

/// Three nodes with the `ha-all` policy and the durable queue [`QUEUE`]
/// declared on A, once both other nodes hold synchronised mirrors.
fn mirrored_three(root: &Path) -> (PathBuf, Vec<Peer>, tokio::runtime::Runtime) {
    mirrored_three_with(root, &[])
}

/// [`mirrored_three`], each node started with the `extra` arguments.
fn mirrored_three_with(
    root: &Path,
    extra: &[&str],
) -> (PathBuf, Vec<Peer>, tokio::runtime::Runtime) {
    let (secret, nodes) = three_with(root, extra);
    set_ha_all(&nodes[0]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    declare_durable(&rt, &nodes[0], QUEUE);
    eventually("two synchronised mirrors", || {
        names(&queue(&nodes[0]), "synchronised_slave_nodes").len() == 2
    });
    (secret, nodes, rt)
}

/// Waits until every node in `holders` holds a copy of [`QUEUE`] with one
/// and the same digest (the same messages in the same order, each settled
/// alike): "synchronised" checked, not taken on trust.
fn replicas_agree(holders: &[&Peer]) {
    let mut seen = Vec::new();
    let path = format!("/api/queues/%2F/{QUEUE}?digest=true");
    eventually("every replica holds the same messages", || {
        seen = holders
            .iter()
            .map(|n| n.get(&path)["local_digest"].clone())
            .collect();
        seen[0].is_string() && seen.iter().all(|d| *d == seen[0])
    });
}

async fn connect(p: &Peer) -> Connection {
    let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", p.amqp);
    Connection::connect(&url, ConnectionProperties::default())
        .await
        .expect("connect")
}

/// A connection through `p` and a channel on it in confirm mode.
async fn confirming(p: &Peer) -> (Connection, Channel) {
    let conn = connect(p).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    (conn, ch)
}

/// A consumer of [`QUEUE`] through `p` tagged `tag`, with manual acks and
/// at most `prefetch` unacked, and the connection and channel it lives on.
async fn consumer(p: &Peer, tag: &str, prefetch: u16) -> (Connection, Channel, Consumer) {
    let conn = connect(p).await;
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(prefetch, BasicQosOptions::default())
        .await
        .unwrap();
    let consumer = ch
        .basic_consume(
            QUEUE.into(),
            tag.into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    (conn, ch, consumer)
}

/// Publishes `n` persistent messages with confirms; returns the bodies acked.
async fn publish_confirmed(p: &Peer, from: usize, n: usize) -> BTreeSet<String> {
    let (conn, ch) = confirming(p).await;
    let acked = publish_each(
        &ch,
        (from..from + n).map(|i| (QUEUE.to_owned(), format!("m{i}"))),
    )
    .await;
    let _ = conn.close(200, "bye".into()).await;
    acked
}

/// Publishes each (queue, body) persistent on `ch`, a channel in confirm
/// mode, all before awaiting any confirm; returns the bodies the broker
/// acked.
async fn publish_each(
    ch: &Channel,
    messages: impl Iterator<Item = (String, String)>,
) -> BTreeSet<String> {
    let mut pending = Vec::new();
    for (queue, body) in messages {
        let confirm = ch
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap();
        pending.push((body, confirm));
    }
    let mut acked = BTreeSet::new();
    for (body, confirm) in pending {
        if confirm.await.is_ok_and(|c| c.is_ack()) {
            acked.insert(body);
        }
    }
    acked
}

/// Consumes through `p` until `want` are all seen (see [`consume_all`]);
/// returns the wanted messages never delivered, and whether any delivery
/// repeated one.
fn drain_missing(
    rt: &tokio::runtime::Runtime,
    p: &Peer,
    want: &BTreeSet<String>,
) -> (Vec<String>, bool) {
    let seen = rt.block_on(consume_all(p, want));
    let seen_set: BTreeSet<String> = seen.iter().cloned().collect();
    let lost = want.difference(&seen_set).cloned().collect();
    (lost, seen.len() != seen_set.len())
}

/// Consumes (acking) until `want` are all seen or nothing came for 3 s;
/// returns every body seen.
async fn consume_all(p: &Peer, want: &BTreeSet<String>) -> Vec<String> {
    let (conn, _ch, mut consumer) = consumer(p, "checker", 100).await;
    let mut seen = Vec::new();
    loop {
        let seen_all = want.iter().all(|w| seen.iter().any(|s: &String| s == w));
        let wait = if seen_all {
            Duration::from_millis(300)
        } else {
            Duration::from_secs(3)
        };
        match tokio::time::timeout(wait, consumer.next()).await {
            Ok(Some(Ok(d))) => {
                seen.push(String::from_utf8_lossy(&d.data).into_owned());
                d.ack(BasicAckOptions::default()).await.unwrap();
            }
            _ => break,
        }
    }
    let _ = conn.close(200, "bye".into()).await;
    seen
}

#[test]
fn a_mirrored_queue_survives_its_masters_sigkill() {
    let root = peers::test_root();
    let (_secret, mut nodes, rt) = mirrored_three(root.path());
    assert_eq!(queue(&nodes[0])["node"], "warren@a");

    let acked = rt.block_on(publish_confirmed(&nodes[0], 0, 500));
    assert_eq!(
        acked.len(),
        500,
        "every publish is confirmed while all are up"
    );
    eventually("the mirrors hold every message", || {
        [&nodes[1], &nodes[2]]
            .iter()
            .all(|n| queue(n)["messages"] == 500 || queue(n)["node"] == "warren@a")
    });
    replicas_agree(&[&nodes[0], &nodes[1], &nodes[2]]);
    // The ring in /metrics: three members, two synchronised (from the
    // master's node), one view version on every member's replica, nothing
    // left pending.
    let series = |name: &str| format!("{name}{{vhost=\"/\",queue=\"{QUEUE}\"}}");
    let replica = |name: &str, n: &Peer| {
        format!(
            "{name}{{vhost=\"/\",queue=\"{QUEUE}\",node=\"{}\"}}",
            n.name
        )
    };
    assert_eq!(
        nodes[0].metric(&series("warren_queue_ring_members")),
        Some(3)
    );
    assert_eq!(
        nodes[0].metric(&series("warren_queue_synchronised_mirrors")),
        Some(2)
    );
    let view = nodes[0]
        .metric(&replica("warren_queue_ring_view", &nodes[0]))
        .expect("a mirrored queue's ring view in /metrics");
    eventually("every member on the same view, nothing pending", || {
        nodes.iter().all(|n| {
            n.metric(&replica("warren_queue_ring_view", n)) == Some(view)
                && n.metric(&replica("warren_queue_ring_pending", n)) == Some(0)
        })
    });
    // The queue's own series come from its master's node alone.
    assert_eq!(nodes[1].metric(&series("warren_queue_ring_members")), None);
    // Every node's replica hub moved its replica's traffic, in turns.
    for n in &nodes {
        let turns = n
            .metric("warren_mirror_hub_turns_total")
            .expect("the hub's turns in /metrics");
        let served = n
            .metric("warren_mirror_hub_replicas_served_total")
            .expect("the replicas the hub served in /metrics");
        assert!(
            turns > 0 && served >= turns,
            "{}: hub turns {turns}, replicas served {served}",
            n.name
        );
    }

    nodes[0].kill();
    let mut master = String::new();
    eventually("a synchronised mirror takes over", || {
        let q = queue(&nodes[1]);
        master = q["node"].as_str().unwrap_or_default().to_owned();
        master == "warren@b" || master == "warren@c"
    });
    let new_master = nodes
        .iter()
        .find(|n| n.name == master)
        .expect("the new master is one of ours");
    eventually("the new master serves the queue", || {
        queue(new_master)["messages"] == 500
    });
    replicas_agree(&[&nodes[1], &nodes[2]]);
    assert!(
        new_master
            .metric(&replica("warren_queue_ring_view", new_master))
            .is_some_and(|v| v > view),
        "the promotion is a new view"
    );
    let (lost, repeated) = drain_missing(&rt, new_master, &acked);
    assert!(lost.is_empty(), "confirmed messages lost: {lost:?}");
    assert!(!repeated, "no message delivered twice");

    // The survivors go on: confirmed publishing works on the new master.
    let more = rt.block_on(publish_confirmed(new_master, 1000, 50));
    assert_eq!(more.len(), 50);
    let seen = rt.block_on(consume_all(new_master, &more));
    assert_eq!(seen.len(), 50);
}

#[test]
fn clients_on_any_node_are_served_by_the_master() {
    let root = peers::test_root();
    let (_secret, mut nodes, rt) = mirrored_three(root.path());
    // Published on a mirror's node, consumed on the other mirror's node.
    let acked = rt.block_on(publish_confirmed(&nodes[1], 0, 300));
    assert_eq!(
        acked.len(),
        300,
        "publishes forwarded to the master are confirmed"
    );
    eventually("the master holds them", || {
        queue(&nodes[0])["messages"] == 300
    });
    let seen = rt.block_on(consume_all(&nodes[2], &acked));
    let seen_set: BTreeSet<String> = seen.iter().cloned().collect();
    assert_eq!(
        seen_set.len(),
        acked.len(),
        "every message once, from the master (saw {})",
        seen.len()
    );
    assert_eq!(seen.len(), 300, "no message delivered twice");
    eventually("the master's queue is empty", || {
        queue(&nodes[0])["messages"] == 0
    });

    // The master dies while a client on another node publishes with confirms:
    // whatever was confirmed is there after the failover.
    let acked = rt.block_on(publish_confirmed(&nodes[1], 1000, 200));
    assert_eq!(acked.len(), 200);
    nodes[0].kill();
    eventually("a synchronised mirror takes over", || {
        let q = queue(&nodes[1]);
        q["node"] == "warren@b" || q["node"] == "warren@c"
    });
    let more = rt.block_on(async {
        let mut more = BTreeSet::new();
        // Until the new master is known everywhere, publishes may be nacked: resend.
        for _ in 0..20 {
            more = publish_confirmed(&nodes[1], 2000, 50).await;
            if more.len() == 50 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        more
    });
    assert_eq!(more.len(), 50, "publishing through a mirror's node resumes");
    let want: BTreeSet<String> = acked.union(&more).cloned().collect();
    let (lost, _) = drain_missing(&rt, &nodes[2], &want);
    assert!(lost.is_empty(), "confirmed messages lost: {lost:?}");
}

/// `basic.get` through a mirror's node: forwarded to the master, acked,
/// rejected and requeued there; a get whose channel closes before the answer
/// leaves its message at the master, not held for the gone channel.
#[test]
fn gets_on_a_mirror_node_are_served_and_settled_by_the_master() {
    let root = peers::test_root();
    let (_secret, nodes, rt) = mirrored_three(root.path());
    let acked = rt.block_on(publish_confirmed(&nodes[0], 0, 3));
    assert_eq!(acked.len(), 3);
    rt.block_on(async {
        let conn = connect(&nodes[1]).await;
        let ch = conn.create_channel().await.unwrap();
        let get = |no_ack| ch.basic_get(QUEUE.into(), BasicGetOptions { no_ack });
        let m0 = get(false).await.unwrap().expect("m0");
        assert_eq!(m0.delivery.data, b"m0");
        assert!(!m0.delivery.redelivered);
        m0.delivery.ack(BasicAckOptions::default()).await.unwrap();
        let m1 = get(false).await.unwrap().expect("m1");
        assert_eq!(m1.delivery.data, b"m1");
        m1.delivery
            .reject(BasicRejectOptions { requeue: true })
            .await
            .unwrap();
        let again = get(true).await.unwrap().expect("m1 again");
        assert_eq!(again.delivery.data, b"m1");
        assert!(
            again.delivery.redelivered,
            "a requeued message is redelivered"
        );

        // A get and the channel's close go out together: the answer finds
        // the channel gone (or the close finds the delivery unacked); either
        // way m2 goes back to the master's queue.
        let ch2 = conn.create_channel().await.unwrap();
        let (_got, closed) = futures::join!(
            ch2.basic_get(QUEUE.into(), BasicGetOptions { no_ack: false }),
            ch2.close(200, "bye".into())
        );
        closed.unwrap();
        let _ = conn.close(200, "bye".into()).await;
    });
    eventually("m2 is ready again at the master", || {
        let q = queue(&nodes[0]);
        q["messages_ready"] == 1 && q["messages_unacknowledged"] == 0
    });
    let left = rt.block_on(async {
        let conn = connect(&nodes[2]).await;
        let ch = conn.create_channel().await.unwrap();
        let m = ch
            .basic_get(QUEUE.into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .expect("m2");
        let _ = conn.close(200, "bye".into()).await;
        m.delivery.data
    });
    assert_eq!(left, b"m2");
}

/// A purge through the management API of a mirror's node is made by the
/// queue's master (a mirror's copy cannot purge: it answered 400 before),
/// as RabbitMQ's API purges through any node.
#[test]
fn a_purge_through_a_mirrors_api_is_made_by_the_master() {
    let root = peers::test_root();
    let (_secret, nodes, rt) = mirrored_three(root.path());
    let acked = rt.block_on(publish_confirmed(&nodes[0], 0, 3));
    assert_eq!(acked.len(), 3);
    eventually("three messages ready", || {
        queue(&nodes[0])["messages_ready"] == 3
    });
    let (status, body) =
        nodes[1].http("DELETE", &format!("/api/queues/%2F/{QUEUE}/contents"), None);
    assert_eq!(status, 204, "{body}");
    eventually("the queue is empty at its master", || {
        queue(&nodes[0])["messages_ready"] == 0
    });
}

#[test]
fn graceful_stop_hands_over_and_a_restarted_node_resyncs() {
    let root = peers::test_root();
    let (secret, mut nodes, rt) = mirrored_three(root.path());
    let acked = rt.block_on(publish_confirmed(&nodes[2], 0, 300));
    assert_eq!(acked.len(), 300);

    // SIGTERM the master: a synchronised mirror takes over at once.
    nodes[0].terminate();
    eventually("a synchronised mirror took over", || {
        let q = queue(&nodes[1]);
        (q["node"] == "warren@b" || q["node"] == "warren@c") && q["messages"] == 300
    });

    // The old master comes back as a mirror: it drops what it held and is
    // synchronised again (ha-sync-mode automatic).
    let dir = nodes[0].dir.clone();
    nodes[0] = Peer::start("warren@a", &dir, &secret, None);
    eventually("the restarted node is a synchronised mirror", || {
        let q = queue(&nodes[1]);
        names(&q, "synchronised_slave_nodes").contains(&"warren@a".to_owned())
    });
    replicas_agree(&[&nodes[0], &nodes[1], &nodes[2]]);
    // Stop the new master too: the restarted node may now be promoted, and
    // it must hold every confirmed message.
    let master = queue(&nodes[1])["node"].as_str().unwrap().to_owned();
    let idx = nodes.iter().position(|n| n.name == master).unwrap();
    nodes[idx].terminate();
    let survivor = if idx == 1 { 2 } else { 1 };
    eventually("another synchronised mirror took over", || {
        let q = queue(&nodes[survivor]);
        q["node"] != master.as_str() && q["node"].is_string()
    });
    let (lost, repeated) = drain_missing(&rt, &nodes[0], &acked);
    assert!(
        lost.is_empty(),
        "{} confirmed messages lost; queue on the survivor: {}",
        lost.len(),
        queue(&nodes[survivor])
    );
    assert!(!repeated, "no message delivered twice");
}

#[test]
fn consumers_that_ask_are_cancelled_on_failover() {
    let root = peers::test_root();
    let (_secret, mut nodes, rt) = mirrored_three(root.path());
    rt.block_on(async {
        // On b: one consumer asks to be cancelled on failover, one does not.
        let conn = connect(&nodes[1]).await;
        let ch = conn.create_channel().await.unwrap();
        let mut args = FieldTable::default();
        args.insert("x-cancel-on-ha-failover".into(), true.into());
        let mut cancelling = ch
            .basic_consume(
                QUEUE.into(),
                "cancel-me".into(),
                BasicConsumeOptions::default(),
                args,
            )
            .await
            .unwrap();
        let mut staying = ch
            .basic_consume(
                QUEUE.into(),
                "stay".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        nodes[0].kill();
        // lapin ends a consumer's stream when the server cancels it.
        let ended = tokio::time::timeout(Duration::from_secs(30), async {
            while cancelling.next().await.is_some() {}
        })
        .await;
        assert!(
            ended.is_ok(),
            "the x-cancel-on-ha-failover consumer was cancelled"
        );
        // The other one carries on with the new master.
        let acked = publish_confirmed(&nodes[2], 0, 10).await;
        assert_eq!(acked.len(), 10);
        let mut got = 0;
        while got < 10 {
            let d = tokio::time::timeout(Duration::from_secs(10), staying.next())
                .await
                .expect("deliveries after the failover")
                .expect("the consumer stays")
                .unwrap();
            d.ack(BasicAckOptions::default()).await.unwrap();
            got += 1;
        }
    });
}

/// A publisher on a mirror's node that was SIGKILLed and restarted is
/// answered at once, each of several times: its master can fail its first
/// send back to the restarted node (still reported down there), dropping
/// the node's forwarded publishes with it, and must then make the node
/// give them up too (nacked) rather than leave it waiting for confirms
/// that never come (the publisher hung, 3–28 s in a chaos kill schedule).
#[test]
fn a_publisher_on_a_restarted_mirror_node_is_answered() {
    let root = peers::test_root();
    let (secret, mut nodes, rt) = mirrored_three(root.path());
    for round in 0..8 {
        nodes[2].kill();
        eventually("the master sees the node down", || {
            !names(&queue(&nodes[0]), "slave_nodes").contains(&"warren@c".to_owned())
        });
        nodes[2] = nodes[2].restart(&secret, &[]);
        rt.block_on(async {
            let (conn, ch) = confirming(&nodes[2]).await;
            // Batches of 20 until one is acked whole, every confirm (ack
            // or nack) within 10 s.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            for batch in 0.. {
                let bodies = (0..20).map(|i| (QUEUE.to_owned(), format!("r{round}-b{batch}-m{i}")));
                let acked = tokio::time::timeout_at(deadline, publish_each(&ch, bodies))
                    .await
                    .unwrap_or_else(|_| {
                        panic!("round {round}: a publish on the restarted node was not answered in 10 s")
                    });
                if acked.len() == 20 {
                    break;
                }
            }
            let _ = conn.close(200, "bye".into()).await;
        });
    }
}

fn set_policy(p: &Peer, definition: Value) {
    set_named_policy(p, "ha", definition);
}

/// Sets the policy `name` for the queues named `ha.*` through `p`.
fn set_named_policy(p: &Peer, name: &str, definition: Value) {
    let (status, v) = p.http(
        "PUT",
        &format!("/api/policies/%2F/{name}"),
        Some(&json!({"pattern": "^ha\\.", "apply-to": "queues", "definition": definition})),
    );
    assert!(status == 201 || status == 204, "set policy: {status} {v}");
}

#[test]
fn graceful_stop_of_a_master_without_synchronised_mirrors_promotes_none() {
    let root = peers::test_root();
    let (secret, mut nodes) = three(root.path());
    let rt = tokio::runtime::Runtime::new().unwrap();
    declare_durable(&rt, &nodes[0], QUEUE);
    let acked = rt.block_on(publish_confirmed(&nodes[0], 0, 200));
    assert_eq!(acked.len(), 200);
    // Mirrors added after the messages, with manual sync: unsynchronised.
    set_policy(
        &nodes[0],
        json!({"ha-mode": "all", "ha-sync-mode": "manual"}),
    );
    eventually("two unsynchronised mirrors", || {
        let q = queue(&nodes[0]);
        names(&q, "slave_nodes").len() == 2 && names(&q, "synchronised_slave_nodes").is_empty()
    });

    // SIGTERM the master: ha-promote-on-shutdown is when-synced, so no
    // mirror (neither holds the 200 messages) takes over.
    nodes[0].terminate();
    eventually("the others see the master's node stopped", || {
        names(&nodes[1].get("/api/cluster"), "running_nodes").len() == 2
    });
    // Publishes through a mirror's node wait for the master: not confirmed.
    let during = rt.block_on(async {
        tokio::time::timeout(
            Duration::from_secs(20),
            publish_confirmed(&nodes[1], 5000, 5),
        )
        .await
        .unwrap_or_default()
    });
    assert!(during.is_empty(), "confirmed without a master: {during:?}");
    let q = queue(&nodes[1]);
    assert_eq!(
        q["node"], "warren@a",
        "no unsynchronised mirror promoted: {q}"
    );

    // The master comes back with every confirmed message and serves again.
    let dir = nodes[0].dir.clone();
    nodes[0] = Peer::start("warren@a", &dir, &secret, None);
    eventually("the master serves its messages again", || {
        let q = queue(&nodes[0]);
        q["node"] == "warren@a" && q["messages"] == 200
    });
    let (lost, _) = drain_missing(&rt, &nodes[1], &acked);
    assert!(lost.is_empty(), "confirmed messages lost: {lost:?}");
}

#[test]
fn policy_changes_under_load_lose_nothing() {
    let root = peers::test_root();
    let (_secret, nodes) = three(root.path());
    set_policy(
        &nodes[0],
        json!({"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"}),
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    declare_durable(&rt, &nodes[0], QUEUE);
    eventually("exactly 2: one synchronised mirror", || {
        let q = queue(&nodes[0]);
        names(&q, "slave_nodes").len() == 1 && names(&q, "synchronised_slave_nodes").len() == 1
    });
    let mut acked = BTreeSet::new();
    let mut batch = 0;
    let mut publish = |acked: &mut BTreeSet<String>| {
        // A publisher on b, through every change.
        let got = rt.block_on(publish_confirmed(&nodes[1], batch * 100, 100));
        batch += 1;
        acked.extend(got);
    };
    publish(&mut acked);
    set_policy(
        &nodes[0],
        json!({"ha-mode": "all", "ha-sync-mode": "automatic"}),
    );
    publish(&mut acked);
    eventually("all: two synchronised mirrors", || {
        names(&queue(&nodes[0]), "synchronised_slave_nodes").len() == 2
    });
    publish(&mut acked);
    set_policy(
        &nodes[0],
        json!({"ha-mode": "nodes", "ha-params": ["warren@c"], "ha-sync-mode": "automatic"}),
    );
    publish(&mut acked);
    eventually("nodes [c]: the master moved to c, no mirror left", || {
        let q = queue(&nodes[1]);
        q["node"] == "warren@c" && names(&q, "slave_nodes").is_empty()
    });
    publish(&mut acked);
    let (status, _) = nodes[0].http("DELETE", "/api/policies/%2F/ha", None);
    assert_eq!(status, 204);
    publish(&mut acked);
    eventually("cleared: not mirrored, still on c", || {
        let q = queue(&nodes[1]);
        q["node"] == "warren@c" && names(&q, "slave_nodes").is_empty() && q["policy"].is_null()
    });
    publish(&mut acked);
    assert!(
        acked.len() >= 600,
        "most publishes confirmed ({})",
        acked.len()
    );
    let (lost, _) = drain_missing(&rt, &nodes[0], &acked);
    assert!(
        lost.is_empty(),
        "{} confirmed messages lost: {lost:?}",
        lost.len()
    );
}

/// Three nodes whose policy mirrors every `ha.` queue to b and c alone
/// (`ha-mode: nodes`): a queue declared through a moves its master away.
fn three_mirroring_to_b_and_c() -> (tempfile::TempDir, Vec<Peer>, tokio::runtime::Runtime) {
    let root = peers::test_root();
    let (_secret, nodes) = three(root.path());
    set_policy(
        &nodes[0],
        json!({"ha-mode": "nodes", "ha-params": ["warren@b", "warren@c"], "ha-sync-mode": "automatic"}),
    );
    (root, nodes, tokio::runtime::Runtime::new().unwrap())
}

/// A queue declared through a node its policy does not list: its master
/// moves away once a listed node is synchronised (RabbitMQ's `ha-mode:
/// nodes`), while the client publishes right after declare-ok, as the
/// client libraries' own test suites do. Every publish is confirmed
/// (RabbitMQ's channels also send each publish to the mirrors, so its
/// promoted mirror confirms them); before, the moving master nacked those
/// in flight and refused the next ones.
#[test]
fn a_master_moved_by_its_policy_nacks_no_publish_in_flight() {
    let (_root, nodes, rt) = three_mirroring_to_b_and_c();
    let mut want = BTreeSet::new();
    for round in 0..4 {
        let name = format!("ha.moving{round}");
        let nacked = rt.block_on(async {
            let (conn, ch) = confirming(&nodes[0]).await;
            let opts = QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            };
            ch.queue_declare(name.as_str().into(), opts, FieldTable::default())
                .await
                .unwrap();
            // Batches until the master has moved, and one after.
            let mut nacked = Vec::new();
            let mut after = 0;
            for batch in 0..200 {
                let bodies: Vec<(String, String)> = (0..20)
                    .map(|i| (name.clone(), format!("{name}-b{batch}-m{i}")))
                    .collect();
                let acked = publish_each(&ch, bodies.clone().into_iter()).await;
                for (_, body) in bodies {
                    if acked.contains(&body) {
                        want.insert(body);
                    } else {
                        nacked.push(body);
                    }
                }
                let moved = queue_named(&nodes[0], &name)["node"] != "warren@a";
                after += u32::from(moved);
                if after == 2 {
                    break;
                }
            }
            assert_eq!(after, 2, "round {round}: the master never moved");
            // A declare right after counts every confirmed publish (the
            // new master's count, as a passive declare on RabbitMQ).
            let passive = QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            };
            let ok = ch
                .queue_declare(name.as_str().into(), passive, FieldTable::default())
                .await
                .unwrap();
            let prefix = format!("{name}-");
            let confirmed = want.iter().filter(|b| b.starts_with(&prefix)).count();
            assert_eq!(ok.message_count() as usize, confirmed, "round {round}");
            let _ = conn.close(200, "bye".into()).await;
            nacked
        });
        assert!(nacked.is_empty(), "round {round}: nacked {nacked:?}");
    }
    // Each confirmed once: neither lost nor taken twice in the move.
    for round in 0..4 {
        let name = format!("ha.moving{round}");
        let prefix = format!("{name}-");
        let mine = want.iter().filter(|b| b.starts_with(&prefix)).count();
        eventually("the new master holds every confirmed publish", || {
            queue_named(&nodes[1], &name)["messages"] == mine
        });
    }
}

/// A get right after a publish finds the message while the queue's
/// policy moves its master away from the declaring node, as on RabbitMQ:
/// while the queue has no master the get waits for the next one, after the
/// publish. Before, it came back empty then; and a master that handed over
/// before its mirror knew itself synchronised left the queue with none
/// (publishes nacked after 10 s): aio-pika's `test_big_message` and binding
/// tests against a cluster.
#[test]
fn a_get_after_a_publish_finds_it_while_the_master_moves() {
    let (_root, nodes, rt) = three_mirroring_to_b_and_c();
    rt.block_on(async {
        let conn = connect(&nodes[0]).await;
        let ch = conn.create_channel().await.unwrap();
        for round in 0..4 {
            let name = format!("ha.get{round}");
            ch.queue_declare(
                name.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
            // Round trips until the master has moved, and a few after.
            let mut after = 0;
            for i in 0..2_000 {
                let body = format!("m{round}-{i}");
                publish_each(&ch, std::iter::once((name.clone(), body.clone()))).await;
                let got = ch
                    .basic_get(name.as_str().into(), BasicGetOptions { no_ack: true })
                    .await
                    .unwrap()
                    .map(|m| {
                        format!(
                            "{}{}",
                            String::from_utf8_lossy(&m.delivery.data),
                            if m.delivery.redelivered {
                                " (redelivered)"
                            } else {
                                ""
                            }
                        )
                    });
                assert_eq!(got.as_deref(), Some(body.as_str()), "round {round}");
                if i % 10 == 9 && queue_named(&nodes[0], &name)["node"] != "warren@a" {
                    after += 1;
                    if after == 3 {
                        break;
                    }
                }
            }
            assert_eq!(after, 3, "round {round}: the master never moved");
        }
        let _ = conn.close(200, "bye".into()).await;
    });
}

#[test]
fn a_new_node_gets_an_unsynchronised_mirror_until_sync_queue() {
    let root = peers::test_root();
    let secret = root.path().join("secret");
    std::fs::write(&secret, "cluster-test-secret\n").unwrap();
    let a = Peer::start("warren@a", &root.path().join("a"), &secret, None);
    let b = Peer::start("warren@b", &root.path().join("b"), &secret, Some(&a.peers));
    set_policy(&a, json!({"ha-mode": "all", "ha-sync-mode": "manual"}));
    let rt = tokio::runtime::Runtime::new().unwrap();
    declare_durable(&rt, &a, QUEUE);
    // b's mirror started with the queue empty: synchronised at once.
    eventually("b is a synchronised mirror", || {
        names(&queue(&a), "synchronised_slave_nodes") == ["warren@b"]
    });
    let mut acked = rt.block_on(publish_confirmed(&b, 0, 1000));
    assert_eq!(acked.len(), 1000);

    let c = Peer::start("warren@c", &root.path().join("c"), &secret, Some(&a.peers));
    eventually("c is a mirror, not synchronised (manual)", || {
        let q = queue(&a);
        names(&q, "slave_nodes").contains(&"warren@c".to_owned())
            && !names(&q, "synchronised_slave_nodes").contains(&"warren@c".to_owned())
    });
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        !names(&queue(&a), "synchronised_slave_nodes").contains(&"warren@c".to_owned()),
        "manual sync mode waits for sync_queue"
    );
    // sync_queue on the master's node; the queue keeps serving meanwhile.
    let (status, v) = a.http(
        "POST",
        &format!("/api/queues/%2F/{QUEUE}/actions"),
        Some(&json!({"action": "sync"})),
    );
    assert!((200..300).contains(&status), "sync: {status} {v}");
    acked.extend(rt.block_on(publish_confirmed(&c, 1000, 200)));
    eventually("c is synchronised", || {
        names(&queue(&a), "synchronised_slave_nodes").contains(&"warren@c".to_owned())
    });
    assert_eq!(
        queue(&c)["messages"],
        1200,
        "c's API shows the master's count"
    );
    let seen = rt.block_on(consume_all(&c, &acked));
    let seen_set: BTreeSet<String> = seen.iter().cloned().collect();
    assert_eq!(seen_set.len(), 1200);
    drop((a, b, c));
}

/// What a publisher and a consumer saw while nodes were killed.
struct History {
    confirmed: BTreeSet<String>,
    /// Publishes nacked.
    nacked: BTreeSet<String>,
    delivered: Vec<(String, bool)>,
    /// The queue as the consumer's node shows it at the end.
    after: Value,
}

/// Publishes with confirms on `pub_node` and consumes (acking) on
/// `con_node` while `fault` runs after a second; keeps going 3 s after it,
/// then drains.
fn under_load(
    rt: &tokio::runtime::Runtime,
    tag: &'static str,
    pub_node: &Peer,
    con_node: &Peer,
    fault: impl FnOnce(),
) -> History {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    let stop = Arc::new(AtomicBool::new(false));
    let confirmed = Arc::new(Mutex::new(BTreeSet::new()));
    let nacked = Arc::new(Mutex::new(BTreeSet::new()));
    let delivered = Arc::new(Mutex::new(Vec::new()));
    let pub_url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", pub_node.amqp);
    let con_url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", con_node.amqp);
    let publisher = {
        let (stop, confirmed, nacked) = (stop.clone(), confirmed.clone(), nacked.clone());
        rt.spawn(async move {
            let conn = Connection::connect(&pub_url, ConnectionProperties::default())
                .await
                .unwrap();
            let ch = conn.create_channel().await.unwrap();
            ch.confirm_select(ConfirmSelectOptions::default())
                .await
                .unwrap();
            let mut i = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let mut batch = Vec::new();
                for _ in 0..50 {
                    let body = format!("{tag}{i}");
                    i += 1;
                    let Ok(c) = ch
                        .basic_publish(
                            "".into(),
                            QUEUE.into(),
                            BasicPublishOptions::default(),
                            body.as_bytes(),
                            BasicProperties::default().with_delivery_mode(2),
                        )
                        .await
                    else {
                        return;
                    };
                    batch.push((body, c));
                }
                // A master in a minority never confirms: give up on a batch
                // after a while (those publishes count as unconfirmed).
                let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
                for (body, c) in batch {
                    match tokio::time::timeout_at(deadline, c).await {
                        Ok(Ok(c)) if c.is_ack() => confirmed.lock().unwrap().insert(body),
                        Ok(Ok(_)) => nacked.lock().unwrap().insert(body),
                        _ => false,
                    };
                }
            }
            let _ = conn.close(200, "bye".into()).await;
        })
    };
    let consumer = {
        let delivered = delivered.clone();
        rt.spawn(async move {
            let conn = Connection::connect(&con_url, ConnectionProperties::default())
                .await
                .unwrap();
            let ch = conn.create_channel().await.unwrap();
            ch.basic_qos(100, BasicQosOptions::default()).await.unwrap();
            let mut consumer = ch
                .basic_consume(
                    QUEUE.into(),
                    "load".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
            while let Ok(Some(Ok(d))) =
                tokio::time::timeout(Duration::from_secs(8), consumer.next()).await
            {
                delivered
                    .lock()
                    .unwrap()
                    .push((String::from_utf8_lossy(&d.data).into_owned(), d.redelivered));
                let _ = d.ack(BasicAckOptions::default()).await;
            }
        })
    };
    std::thread::sleep(Duration::from_secs(1));
    fault();
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, Ordering::SeqCst);
    rt.block_on(publisher).unwrap();
    rt.block_on(consumer).unwrap();
    let confirmed = confirmed.lock().unwrap().clone();
    let nacked = nacked.lock().unwrap().clone();
    let delivered = delivered.lock().unwrap().clone();
    History {
        confirmed,
        nacked,
        delivered,
        after: queue(con_node),
    }
}

/// Every confirmed message was delivered at least once; a message
/// delivered twice came the second time with the redelivered flag.
fn check(h: &History) {
    let seen: BTreeSet<String> = h.delivered.iter().map(|(b, _)| b.clone()).collect();
    let lost: Vec<&String> = h.confirmed.difference(&seen).collect();
    assert!(!h.confirmed.is_empty(), "some publishes were confirmed");
    assert!(
        lost.is_empty(),
        "{} of {} confirmed messages lost: {lost:?}; the queue afterwards: {}",
        lost.len(),
        h.confirmed.len(),
        h.after
    );
    let mut first = BTreeSet::new();
    for (b, redelivered) in &h.delivered {
        if !first.insert(b.clone()) {
            assert!(
                redelivered,
                "{b} delivered again without the redelivered flag"
            );
        }
    }
}

#[test]
fn sigkill_of_the_master_or_a_mirror_under_load_loses_no_confirmed_message() {
    let root = peers::test_root();
    let (_secret, mut nodes, rt) = mirrored_three(root.path());
    // The master (a) dies; publisher on b, consumer on c. The publishes
    // forwarded to a and not confirmed go to the next master, which
    // confirms those it holds: none is nacked (RabbitMQ's publishers see
    // no nack either: its mirrors hold each publish from the channel too).
    let pid = nodes[0].pid();
    let h = under_load(&rt, "master-", &nodes[1], &nodes[2], || peers::sigkill(pid));
    check(&h);
    assert!(h.nacked.is_empty(), "nacked: {:?}", h.nacked);
    // a comes back (a mirror again), then a mirror dies; publisher and
    // consumer on the master's node.
    let dir = nodes[0].dir.clone();
    nodes[0] = Peer::start("warren@a", &dir, &_secret, None);
    eventually("two synchronised mirrors again", || {
        names(&queue(&nodes[1]), "synchronised_slave_nodes").len() == 2
    });
    let master = queue(&nodes[1])["node"].as_str().unwrap().to_owned();
    let (m, mirror) = if master == "warren@b" { (1, 2) } else { (2, 1) };
    let pid = nodes[mirror].pid();
    let h = under_load(&rt, "mirror-", &nodes[m], &nodes[m], || peers::sigkill(pid));
    check(&h);
}

#[test]
fn a_graceful_stop_of_the_master_under_load_loses_no_confirmed_message() {
    let root = peers::test_root();
    let (_secret, mut nodes, rt) = mirrored_three(root.path());
    // The master (a) stops cleanly while b's publisher keeps publishing to
    // it: a publish forwarded to a after its replica ended must not be
    // confirmed from a's disk alone (seen once in `cargo xtask chaos --seed 22`).
    let (first, rest) = nodes.split_at_mut(1);
    let h = under_load(&rt, "stop-", &rest[0], &rest[1], || first[0].terminate());
    check(&h);
}

#[test]
fn two_nodes_of_five_sigkilled_under_load_lose_no_confirmed_message() {
    let root = peers::test_root();
    let secret = root.path().join("secret");
    std::fs::write(&secret, "cluster-test-secret\n").unwrap();
    let first = Peer::start("warren@a", &root.path().join("a"), &secret, None);
    let seed = first.peers.clone();
    let mut nodes = vec![first];
    for n in ["b", "c", "d", "e"] {
        nodes.push(Peer::start(
            &format!("warren@{n}"),
            &root.path().join(n),
            &secret,
            Some(&seed),
        ));
    }
    for n in &nodes {
        eventually("five running members", || {
            names(&n.get("/api/cluster"), "running_nodes").len() == 5
        });
    }
    set_ha_all(&nodes[0]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    declare_durable(&rt, &nodes[0], QUEUE);
    eventually("four synchronised mirrors", || {
        names(&queue(&nodes[0]), "synchronised_slave_nodes").len() == 4
    });
    // The master (a) and a mirror (b) die together; publisher on c,
    // consumer on d.
    let (pa, pb) = (nodes[0].pid(), nodes[1].pid());
    let h = under_load(&rt, "two-of-five-", &nodes[2], &nodes[3], || {
        peers::sigkill(pa);
        peers::sigkill(pb);
    });
    check(&h);
}

#[test]
fn a_consumer_cancelled_on_another_node_strands_no_message() {
    let root = peers::test_root();
    let (_secret, nodes, rt) = mirrored_three(root.path());
    let acked = rt.block_on(publish_confirmed(&nodes[1], 0, 1000));
    assert_eq!(acked.len(), 1000);
    // A consumer on a mirror's node without a prefetch limit cancels at once,
    // while the master's deliveries to it are on their way: those come back
    // to the queue instead of staying unacknowledged at the master.
    rt.block_on(async {
        let conn = connect(&nodes[2]).await;
        let ch = conn.create_channel().await.unwrap();
        let _c = ch
            .basic_consume(
                QUEUE.into(),
                "short".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        ch.basic_cancel("short".into(), BasicCancelOptions::default())
            .await
            .unwrap();
        // What reached the client stays unacked until the close requeues it.
        tokio::time::sleep(Duration::from_millis(500)).await;
        conn.close(200, "bye".into()).await.unwrap();
    });
    eventually("every message ready again at the master", || {
        let q = queue(&nodes[0]);
        q["messages_unacknowledged"] == 0 && q["messages_ready"] == 1000
    });
    let (lost, _) = drain_missing(&rt, &nodes[1], &acked);
    assert!(lost.is_empty(), "stranded: {lost:?}");
}

/// Confirms on one channel are not held back by a publish to another queue
/// that cannot be confirmed yet (RabbitMQ acks them out of order): here the
/// mirrored queue waits for more synchronised members than the cluster has.
#[test]
fn a_confirm_is_not_held_back_by_an_earlier_publish_to_a_slower_queue() {
    let root = peers::test_root();
    let (_secret, nodes) = three(root.path());
    set_policy(
        &nodes[0],
        json!({"ha-mode": "all", "ha-min-sync-replicas": 4}),
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    declare_durable(&rt, &nodes[0], QUEUE);
    declare_durable(&rt, &nodes[0], "plain");
    eventually("two synchronised mirrors", || {
        names(&queue(&nodes[0]), "synchronised_slave_nodes").len() == 2
    });
    rt.block_on(async {
        let conn = connect(&nodes[0]).await;
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let publish = |queue: &'static str| {
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                b"x",
                BasicProperties::default().with_delivery_mode(2),
            )
        };
        let mut held = publish(QUEUE).await.unwrap();
        let plain = publish("plain").await.unwrap();
        let confirm = tokio::time::timeout(Duration::from_secs(20), plain)
            .await
            .expect("the confirm of the later publish is not held back")
            .unwrap();
        assert!(confirm.is_ack());
        assert!(
            tokio::time::timeout(Duration::from_millis(300), &mut held)
                .await
                .is_err(),
            "three members are fewer than ha-min-sync-replicas 4"
        );
        set_policy(&nodes[0], json!({"ha-mode": "all"}));
        let confirm = tokio::time::timeout(Duration::from_secs(20), held)
            .await
            .expect("confirmed once the policy asks for fewer members")
            .unwrap();
        assert!(confirm.is_ack());
        conn.close(200, "bye".into()).await.unwrap();
    });
}

#[test]
fn a_consumer_on_another_node_receives_more_than_the_output_limit() {
    // Deliveries to another node's consumers once stopped for good after
    // 4 MiB (the link's output was counted and never written off).
    let root = peers::test_root();
    let (_secret, nodes, rt) = mirrored_three(root.path());
    const N: usize = 6_000;
    rt.block_on(async {
        let (conn, ch) = confirming(&nodes[0]).await;
        let mut body = vec![b'x'; 1024];
        let mut pending = Vec::new();
        for i in 0..N {
            body[..8].copy_from_slice(&(i as u64).to_be_bytes());
            pending.push(
                ch.basic_publish(
                    "".into(),
                    QUEUE.into(),
                    BasicPublishOptions::default(),
                    &body,
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .unwrap(),
            );
        }
        for c in pending {
            assert!(c.await.unwrap().is_ack());
        }
        let _ = conn.close(200, "bye".into()).await;
        // 6 MiB through node b's consumer, with manual acks.
        let (conn, _ch, mut consumer) = consumer(&nodes[1], "far", 200).await;
        let mut seen = vec![false; N];
        let mut got = 0;
        while got < N {
            let next = tokio::time::timeout(Duration::from_secs(10), consumer.next()).await;
            let Ok(Some(Ok(d))) = next else {
                panic!("deliveries stopped after {got} of {N}");
            };
            let i = u64::from_be_bytes(d.data[..8].try_into().unwrap()) as usize;
            if !std::mem::replace(&mut seen[i], true) {
                got += 1;
            }
            d.ack(BasicAckOptions::default()).await.unwrap();
        }
        let _ = conn.close(200, "bye".into()).await;
    });
}

#[test]
fn publishes_right_after_declare_ok_on_a_new_mirrored_queue_are_confirmed() {
    let root = peers::test_root();
    let (_secret, nodes) = three(root.path());
    set_ha_all(&nodes[0]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        for (i, node) in nodes.iter().enumerate() {
            for round in 0..2 {
                let name = format!("ha.fresh-{i}-{round}");
                let conn = connect(node).await;
                let ch = conn.create_channel().await.unwrap();
                ch.confirm_select(ConfirmSelectOptions::default())
                    .await
                    .unwrap();
                ch.queue_declare(
                    name.as_str().into(),
                    QueueDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .unwrap();
                let mut pending = Vec::new();
                for n in 0..50 {
                    pending.push(
                        ch.basic_publish(
                            "".into(),
                            name.as_str().into(),
                            BasicPublishOptions::default(),
                            format!("m{n}").as_bytes(),
                            BasicProperties::default().with_delivery_mode(2),
                        )
                        .await
                        .unwrap(),
                    );
                }
                let mut acked = 0;
                for c in pending {
                    match tokio::time::timeout(Duration::from_secs(30), c).await {
                        Ok(Ok(c)) if c.is_ack() => acked += 1,
                        other => panic!(
                            "{name} via {}: publish {acked} not confirmed: {other:?}",
                            node.name
                        ),
                    }
                }
                assert_eq!(acked, 50);
                let _ = conn.close(200, "bye".into()).await;
                // Confirmed means held: the queue has all 50.
                let path = format!("/api/queues/%2F/{name}");
                eventually("the 50 messages in the queue", || {
                    node.get(&path)["messages"] == 50
                });
            }
        }
    });
}

/// RabbitMQ answers `declare-ok` once every node's schema has the queue: a
/// client that declares through one node and publishes through another at
/// once finds it there (Warren: the change is applied on every running
/// member before the answer).
#[test]
fn a_queue_declared_through_one_node_is_usable_through_another_at_once() {
    let root = peers::test_root();
    let (_secret, nodes) = three(root.path());
    set_ha_all(&nodes[0]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (a, b) = (connect(&nodes[0]).await, connect(&nodes[1]).await);
        let declarer = a.create_channel().await.unwrap();
        let user = b.create_channel().await.unwrap();
        user.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        for round in 0..30 {
            let name = format!("ha.at-once-{round}");
            let durable = QueueDeclareOptions {
                durable: true,
                ..Default::default()
            };
            declarer
                .queue_declare(name.as_str().into(), durable, FieldTable::default())
                .await
                .unwrap();
            let mandatory = BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            };
            let confirm = user
                .basic_publish(
                    "".into(),
                    name.as_str().into(),
                    mandatory,
                    b"m",
                    BasicProperties::default(),
                )
                .await
                .unwrap()
                .await
                .unwrap();
            let ok = confirm.is_ack();
            let returned = confirm.take_message();
            assert!(
                ok && returned.is_none(),
                "round {round}: the publish through node 2 was nacked ({ok}) or returned ({returned:?})"
            );
            let got = user
                .basic_get(name.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap_or_else(|e| panic!("round {round}: basic.get through node 2: {e}"));
            assert!(
                got.is_some(),
                "round {round}: the message is not in the queue"
            );
        }
    });
}

#[test]
fn a_mirrored_priority_queue_fails_over_in_priority_order() {
    const PQ: &str = "ha.prio";
    let root = peers::test_root();
    let (_secret, mut nodes) = three(root.path());
    set_ha_all(&nodes[0]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let info = |p: &Peer| {
        let (status, v) = p.http("GET", &format!("/api/queues/%2F/{PQ}"), None);
        if status == 200 { v } else { Value::Null }
    };
    // Message i asks for priority i % 7 (6 counts as the maximum, 5).
    let n = 40u8;
    let mut want: Vec<u8> = (0..n).collect();
    want.sort_by_key(|&i| std::cmp::Reverse((i % 7).min(5)));
    // The master's client keeps the three highest delivered and unacked.
    let _held = rt.block_on(async {
        let conn = connect(&nodes[0]).await;
        let ch = conn.create_channel().await.unwrap();
        let mut args = FieldTable::default();
        args.insert("x-max-priority".into(), AMQPValue::LongInt(5));
        ch.queue_declare(PQ.into(), QueueDeclareOptions::durable(), args)
            .await
            .unwrap();
        eventually("two synchronised mirrors", || {
            names(&info(&nodes[0]), "synchronised_slave_nodes").len() == 2
        });
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        for i in 0..n {
            let props = BasicProperties::default()
                .with_delivery_mode(2)
                .with_priority(i % 7);
            ch.basic_publish(
                "".into(),
                PQ.into(),
                BasicPublishOptions::default(),
                &[i],
                props,
            )
            .await
            .unwrap();
        }
        assert!(ch.wait_for_confirms().await.unwrap().is_empty());
        for &i in &want[..3] {
            let m = ch
                .basic_get(PQ.into(), BasicGetOptions { no_ack: false })
                .await
                .unwrap()
                .expect("a message");
            assert_eq!(m.delivery.data, [i]);
        }
        (conn, ch)
    });

    nodes[0].kill();
    let mut master = String::new();
    eventually("a synchronised mirror takes over", || {
        master = info(&nodes[1])["node"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        master == "warren@b" || master == "warren@c"
    });
    let new_master = nodes.iter().find(|p| p.name == master).unwrap();
    eventually("the new master holds every message", || {
        info(new_master)["messages"] == u64::from(n)
    });
    // Through the other survivor: the promoted mirror delivers in the
    // master's order, the three unacked back at their places, redelivered.
    let other = nodes[1..].iter().find(|p| p.name != master).unwrap();
    let got = rt.block_on(async {
        let conn = connect(other).await;
        let ch = conn.create_channel().await.unwrap();
        let mut got = Vec::new();
        while let Some(m) = ch
            .basic_get(PQ.into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            got.push((m.delivery.data[0], m.delivery.redelivered));
        }
        got
    });
    let expected: Vec<(u8, bool)> = want.iter().enumerate().map(|(k, &i)| (i, k < 3)).collect();
    assert_eq!(got, expected);
}

#[test]
fn non_durable_queues_are_cluster_wide_and_a_mirrored_one_survives_its_masters_sigkill() {
    // RabbitMQ shares transient queues across its cluster: listed and
    // usable through every node, mirrored by a matching policy; one without
    // mirrors goes with its node.
    const HA: &str = "ha.transient";
    const PLAIN: &str = "plain.transient";
    let root = peers::test_root();
    let (secret, mut nodes) = three(root.path());
    set_ha_all(&nodes[0]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let info = |p: &Peer, q: &str| {
        let (status, v) = p.http("GET", &format!("/api/queues/%2F/{q}"), None);
        if status == 200 { v } else { Value::Null }
    };
    rt.block_on(async {
        for (node, q) in [(&nodes[0], HA), (&nodes[2], PLAIN)] {
            let conn = connect(node).await;
            let ch = conn.create_channel().await.unwrap();
            ch.queue_declare(
                q.into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
            conn.close(200, "bye".into()).await.unwrap();
        }
    });
    for n in &nodes {
        for (q, home) in [(HA, "warren@a"), (PLAIN, "warren@c")] {
            let v = info(n, q);
            assert_eq!(v["durable"], false, "{q} listed through {}: {v}", n.name);
            assert_eq!(v["node"], home, "{q}'s node through {}", n.name);
        }
    }
    eventually("two synchronised mirrors of the transient queue", || {
        names(&info(&nodes[0], HA), "synchronised_slave_nodes").len() == 2
    });
    // Transient messages through a mirror's node, confirmed by the master.
    let acked = rt.block_on(async {
        let conn = connect(&nodes[1]).await;
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        for i in 0..100 {
            ch.basic_publish(
                "".into(),
                HA.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                format!("t{i}").as_bytes(),
                BasicProperties::default(),
            )
            .await
            .unwrap();
        }
        let returned = ch.wait_for_confirms().await.unwrap();
        assert!(returned.is_empty(), "routed, not returned");
        conn.close(200, "bye".into()).await.unwrap();
        (0..100).map(|i| format!("t{i}")).collect::<BTreeSet<_>>()
    });
    let digests = |holders: &[&Peer]| -> Vec<Value> {
        let path = format!("/api/queues/%2F/{HA}?digest=true");
        holders
            .iter()
            .map(|n| n.get(&path)["local_digest"].clone())
            .collect()
    };
    eventually("every replica holds the same transient messages", || {
        let d = digests(&[&nodes[0], &nodes[1], &nodes[2]]);
        d[0].is_string() && d.iter().all(|x| *x == d[0])
    });

    nodes[0].kill();
    let mut master = String::new();
    eventually("a mirror takes the transient queue over", || {
        master = info(&nodes[1], HA)["node"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        master == "warren@b" || master == "warren@c"
    });
    // Consumed through the node that is not the new master.
    let other = if master == "warren@b" { 2 } else { 1 };
    let seen = rt.block_on(async {
        let conn = connect(&nodes[other]).await;
        let ch = conn.create_channel().await.unwrap();
        let mut consumer = ch
            .basic_consume(
                HA.into(),
                "after-failover".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let mut seen = BTreeSet::new();
        while seen.len() < acked.len() {
            match tokio::time::timeout(Duration::from_secs(10), consumer.next()).await {
                Ok(Some(Ok(d))) => {
                    seen.insert(String::from_utf8_lossy(&d.data).into_owned());
                }
                _ => break,
            }
        }
        seen
    });
    let lost: Vec<_> = acked.difference(&seen).collect();
    assert!(
        lost.is_empty(),
        "confirmed transient messages lost: {lost:?}"
    );

    // The restarted node finds the mirrored queue served elsewhere; the
    // queue that lived only on a node does not outlive that node's restart.
    nodes[0] = nodes[0].restart(&secret, &[]);
    eventually("the restarted node lists the transient queue", || {
        info(&nodes[0], HA)["node"] == master.as_str()
    });
    nodes[2].kill();
    nodes[2] = nodes[2].restart(&secret, &[]);
    eventually("the lone transient queue went with its node", || {
        nodes
            .iter()
            .all(|n| n.http("GET", &format!("/api/queues/%2F/{PLAIN}"), None).0 == 404)
    });
}

#[test]
fn master_locators_spread_new_queues_over_the_nodes() {
    // RabbitMQ's queue-master-locator: min-masters puts each new queue's
    // master on the node hosting the fewest, as an argument or a policy
    // key; client-local (the default) on the declaring node.
    let root = peers::test_root();
    let (_secret, nodes) = three(root.path());
    set_ha_all(&nodes[0]);
    let (status, v) = nodes[0].http(
        "PUT",
        "/api/policies/%2F/spread",
        Some(&json!({
            "pattern": "^spread\\.",
            "apply-to": "queues",
            "definition": {"queue-master-locator": "min-masters"},
        })),
    );
    assert!(status == 201 || status == 204, "set policy: {status} {v}");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let declare = |name: &str, locator: Option<&str>| {
        rt.block_on(async {
            let conn = connect(&nodes[0]).await;
            let ch = conn.create_channel().await.unwrap();
            let mut args = FieldTable::default();
            if let Some(l) = locator {
                args.insert(
                    "x-queue-master-locator".into(),
                    AMQPValue::LongString(l.into()),
                );
            }
            ch.queue_declare(name.into(), QueueDeclareOptions::durable(), args)
                .await
                .unwrap();
            conn.close(200, "bye".into()).await.unwrap();
        });
    };
    let node_of = |name: &str| {
        let (status, v) = nodes[1].http("GET", &format!("/api/queues/%2F/{name}"), None);
        assert_eq!(status, 200, "{name} listed through b");
        v["node"].as_str().unwrap_or_default().to_owned()
    };
    let spread = |names: &[String]| {
        let mut per_node = std::collections::BTreeMap::new();
        for n in names {
            *per_node.entry(node_of(n)).or_insert(0) += 1;
        }
        per_node.into_values().collect::<Vec<_>>()
    };
    let args: Vec<String> = (0..6).map(|i| format!("arg.{i}")).collect();
    for n in &args {
        declare(n, Some("min-masters"));
    }
    assert_eq!(spread(&args), [2, 2, 2], "min-masters as an argument");
    let by_policy: Vec<String> = (0..3).map(|i| format!("spread.{i}")).collect();
    for n in &by_policy {
        declare(n, None);
    }
    assert_eq!(spread(&by_policy), [1, 1, 1], "min-masters from a policy");
    let local: Vec<String> = (0..3).map(|i| format!("local.{i}")).collect();
    for (i, n) in local.iter().enumerate() {
        declare(n, (i == 0).then_some("client-local"));
    }
    for n in &local {
        assert_eq!(node_of(n), "warren@a", "{n}: client-local");
    }
    // A mirrored queue placed elsewhere: its master is where the locator
    // said, with mirrors on the other nodes; and a queue mastered on
    // another node is usable through every node.
    declare("ha.placed", Some("min-masters"));
    let master = node_of("ha.placed");
    assert_ne!(master, "warren@a", "a hosts the most masters by now");
    eventually("two synchronised mirrors of the placed queue", || {
        let (_, v) = nodes[0].http("GET", "/api/queues/%2F/ha.placed", None);
        names(&v, "synchronised_slave_nodes").len() == 2
    });
    let remote = args
        .iter()
        .find(|n| node_of(n) == "warren@b")
        .expect("a queue mastered on b");
    rt.block_on(async {
        let conn = connect(&nodes[0]).await;
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        ch.basic_publish(
            "".into(),
            remote.as_str().into(),
            BasicPublishOptions::default(),
            b"placed",
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();
        conn.close(200, "bye".into()).await.unwrap();
        let conn = connect(&nodes[2]).await;
        let ch = conn.create_channel().await.unwrap();
        let got = ch
            .basic_get(remote.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .expect("the message, through c");
        assert_eq!(got.delivery.data, b"placed");
        conn.close(200, "bye".into()).await.unwrap();
    });
}

/// `len` bytes that differ with `seed` and along the body (a misplaced or
/// lost chunk shows).
fn patterned(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i % 251) as u8 ^ (i >> 20) as u8 ^ seed)
        .collect()
}

/// Publishes small persistent messages to `queue` through `p` with
/// confirms, 10 in flight, counting confirms in `confirmed`, until `stop`.
async fn publish_small_until(
    p: &Peer,
    queue: &str,
    confirmed: &std::sync::atomic::AtomicU64,
    stop: &std::sync::atomic::AtomicBool,
) {
    use std::sync::atomic::Ordering;
    let (conn, ch) = confirming(p).await;
    let mut pending = std::collections::VecDeque::new();
    while !stop.load(Ordering::Relaxed) {
        while pending.len() < 10 {
            pending.push_back(
                ch.basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    b"small",
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .unwrap(),
            );
        }
        let confirm = pending.pop_front().expect("ten in flight");
        assert!(confirm.await.unwrap().is_ack(), "a small message nacked");
        confirmed.fetch_add(1, Ordering::Relaxed);
    }
    let _ = conn.close(200, "bye".into()).await;
}

#[test]
fn messages_up_to_the_maximum_size_are_confirmed_replicated_and_forwarded_over_tcp() {
    large_messages(&[]);
}

#[test]
fn messages_up_to_the_maximum_size_are_confirmed_replicated_and_forwarded_over_quic() {
    large_messages(&["--transport", "quic"]);
}

/// Messages larger than a peer frame (16 MiB), up to the default
/// `max_message_size` (128 MiB), are confirmed, held alike by every replica
/// and delivered through a node that is not the master (the forwarding
/// link), published through the master and through another node, and a
/// mirror placed again is synchronised with them; meanwhile a publisher of
/// small messages into another mirrored queue, whose ring shares the
/// connections between the nodes, keeps getting confirms. The nodes run
/// with the `extra` arguments.
fn large_messages(extra: &[&str]) {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    const SMALL: &str = "ha.small";
    let root = peers::test_root();
    let (_secret, nodes, rt) = mirrored_three_with(root.path(), extra);
    declare_durable(&rt, &nodes[1], SMALL);
    eventually("two synchronised mirrors of the small queue", || {
        let (_, q) = nodes[1].http("GET", &format!("/api/queues/%2F/{SMALL}"), None);
        names(&q, "synchronised_slave_nodes").len() == 2
    });
    let bodies = [patterned(20 << 20, 1), patterned(128 << 20, 2)];
    let confirmed = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    rt.block_on(async {
        let small = publish_small_until(&nodes[1], SMALL, &confirmed, &stop);
        let big = async {
            while confirmed.load(Ordering::Relaxed) < 10 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // The 20 MiB message through the master, the 128 MiB one
            // through node c (forwarded to the master over the link).
            let mut confirms = Vec::new();
            for (body, via) in bodies.iter().zip([&nodes[0], &nodes[2]]) {
                let (conn, ch) = confirming(via).await;
                let confirm = ch
                    .basic_publish(
                        "".into(),
                        QUEUE.into(),
                        BasicPublishOptions::default(),
                        body,
                        BasicProperties::default().with_delivery_mode(2),
                    )
                    .await
                    .unwrap();
                confirms.push((conn, ch, confirm));
            }
            let before = confirmed.load(Ordering::Relaxed);
            for (conn, _ch, confirm) in confirms {
                let confirm = tokio::time::timeout(Duration::from_secs(180), confirm)
                    .await
                    .expect("a large message confirmed");
                assert!(confirm.unwrap().is_ack(), "a large message nacked");
                let _ = conn.close(200, "bye".into()).await;
            }
            let after = confirmed.load(Ordering::Relaxed);
            // And they go on.
            tokio::time::timeout(Duration::from_secs(30), async {
                while confirmed.load(Ordering::Relaxed) < after + 10 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
            .await
            .expect("small messages confirmed after the large ones");
            stop.store(true, Ordering::Relaxed);
            after - before
        };
        let ((), during) = tokio::join!(small, big);
        assert!(
            during > 0,
            "no small message was confirmed while the large ones moved"
        );
    });
    replicas_agree(&[&nodes[0], &nodes[1], &nodes[2]]);
    // A mirror dropped (exactly 2) and placed again (all) is synchronised:
    // the large messages in sync batches.
    let policy = |definition| set_named_policy(&nodes[0], "ha-all", definition);
    policy(json!({"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"}));
    eventually("exactly 2: one mirror", || {
        names(&queue(&nodes[0]), "slave_nodes").len() == 1
    });
    policy(json!({"ha-mode": "all", "ha-sync-mode": "automatic"}));
    // 148 MiB to copy: a debug build beside the other tests took over 30 s.
    peers::eventually_within(
        "all: two synchronised mirrors again",
        Duration::from_secs(120),
        || names(&queue(&nodes[0]), "synchronised_slave_nodes").len() == 2,
    );
    replicas_agree(&[&nodes[0], &nodes[1], &nodes[2]]);
    // Both through node b's consumer: the master's deliveries cross the link.
    let got = rt.block_on(async {
        let (conn, _ch, mut consumer) = consumer(&nodes[1], "far", 1).await;
        let mut got = Vec::new();
        while got.len() < bodies.len() {
            let next = tokio::time::timeout(Duration::from_secs(60), consumer.next()).await;
            let Ok(Some(Ok(d))) = next else {
                panic!("deliveries stopped after {} large messages", got.len());
            };
            d.ack(BasicAckOptions::default()).await.unwrap();
            got.push(d.data);
        }
        let _ = conn.close(200, "bye".into()).await;
        got
    });
    let mut got: Vec<&Vec<u8>> = got.iter().collect();
    got.sort_by_key(|b| b.len());
    assert_eq!(got.len(), 2);
    for (got, want) in got.into_iter().zip(&bodies) {
        assert_eq!(got.len(), want.len());
        assert!(got == want, "a message of {} bytes corrupted", want.len());
    }
}

#[test]
fn every_node_shows_a_queues_figures_as_its_master_has_them() {
    // RabbitMQ shows one queue's messages and consumers alike through every
    // node; a node that forwards the queue shows its master's figures.
    const Q: &str = "plain.figures";
    let root = peers::test_root();
    let (_secret, nodes) = three(root.path());
    let rt = tokio::runtime::Runtime::new().unwrap();
    declare_durable(&rt, &nodes[0], Q);
    let _consumer = rt.block_on(async {
        let conn = connect(&nodes[0]).await;
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        for i in 0..5 {
            ch.basic_publish(
                "".into(),
                Q.into(),
                BasicPublishOptions::default(),
                format!("f{i}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap();
        }
        assert!(ch.wait_for_confirms().await.unwrap().is_empty());
        // A consumer on the third node that takes two and holds them.
        let far = connect(&nodes[2]).await;
        let fch = far.create_channel().await.unwrap();
        fch.basic_qos(2, BasicQosOptions::default()).await.unwrap();
        let consumer = fch
            .basic_consume(
                Q.into(),
                "holder".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        (conn, far, fch, consumer)
    });
    for n in &nodes {
        eventually(&format!("{}'s figures of {Q}", n.name), || {
            let v = n.get(&format!("/api/queues/%2F/{Q}"));
            v["messages_ready"] == 3
                && v["messages_unacknowledged"] == 2
                && v["messages"] == 5
                && v["consumers"] == 1
        });
        // Its consumer too, whichever node is asked.
        let v = n.get(&format!("/api/queues/%2F/{Q}"));
        let details = v["consumer_details"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert_eq!(details.len(), 1, "{}: {v}", n.name);
        assert_eq!(details[0]["consumer_tag"], "holder");
        assert_eq!(
            details[0]["channel_details"]["node"],
            nodes[2].name.as_str()
        );
    }
}

/// Publishes `body` persistent into `queue` on `ch`; its confirm to await.
async fn publish_persistent(ch: &Channel, queue: &str, body: &[u8]) -> lapin::PublisherConfirm {
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        body,
        BasicProperties::default().with_delivery_mode(2),
    )
    .await
    .unwrap()
}

#[test]
fn a_backlogged_ring_holds_back_its_own_publishers_only() {
    // RabbitMQ's credit flow blocks the publishers of the queue that falls
    // behind; publishers of other queues on the node go on.
    const FAST: &str = "plain.fast";
    let root = peers::test_root();
    // A member silent for 10 s is down (3 s by default): what follows has
    // to fit in the time before the stopped node is dropped, and a loaded
    // CI machine once took longer than 3 s.
    let (_secret, nodes, rt) = mirrored_three_with(root.path(), &["--net-ticktime", "10"]);
    declare_durable(&rt, &nodes[0], FAST);
    // Both publishers connect first.
    let (_slow_conn, slow, _fast_conn, fast) = rt.block_on(async {
        let (slow_conn, slow) = confirming(&nodes[0]).await;
        let (fast_conn, fast) = confirming(&nodes[0]).await;
        (slow_conn, slow, fast_conn, fast)
    });
    // A mirror stopped (not down yet: the failure detector waits 10 s):
    // the ring of the mirrored queue stops moving and its publishes pile up.
    let signal = |sig: &str| nodes[2].signal(sig);
    signal("-STOP");
    let (held, fast_confirmed, after) = rt.block_on(async {
        let mut slow_confirms = Vec::new();
        for _ in 0..6_000 {
            let confirm = publish_persistent(&slow, QUEUE, b"slow").await;
            slow_confirms.push(confirm);
        }
        // The ring's turns count its backlog as it grows; past 4,000 the
        // queue holds its publisher back (until the ring drops the stopped
        // node from its view, once it is down).
        let mut held = 0;
        for _ in 0..100 {
            held = queue(&nodes[0])["messages"].as_u64().unwrap_or(0);
            if held > 4_000 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Another publisher on the same node, into a queue with no ring,
        // one confirm at a time (each publish read after the last confirm),
        // while the first is still held back.
        let fast = tokio::time::timeout(Duration::from_secs(20), async {
            let mut acked = 0;
            for _ in 0..3 {
                let confirm = publish_persistent(&fast, FAST, b"fast").await;
                if confirm.await.is_ok_and(|c| c.is_ack()) {
                    acked += 1;
                }
            }
            acked
        })
        .await;
        let after = queue(&nodes[0])["messages"].as_u64().unwrap_or(0);
        (held, fast, after)
    });
    signal("-CONT");
    assert!(
        held > 4_000 && held < 6_000,
        "the mirrored queue's publisher was not held back ({held} of 6,000 published)"
    );
    assert_eq!(
        fast_confirmed,
        Ok(3),
        "a publisher into another queue got no confirms"
    );
    // Before the fix the other publisher waited until the ring dropped the
    // stopped node and the held publisher had gone on.
    assert!(
        after < 6_000,
        "the other publisher's confirms came only after the mirrored queue's backlog cleared"
    );
}

#[test]
fn a_clean_stop_of_a_cluster_in_use_logs_no_warning_or_error() {
    // What an operator reads after stopping a healthy cluster, at the
    // default log level: nodes stopping one after the other (the first,
    // the Raft leader, last) while clients are connected, a mirrored queue
    // in use, is no fault.
    peers::use_default_logs();
    let root = peers::test_root();
    let (_secret, mut nodes, rt) = mirrored_three(root.path());
    let clients = rt.block_on(async {
        let (pc, pch) = confirming(&nodes[1]).await;
        for _ in 0..200 {
            let confirm = publish_persistent(&pch, QUEUE, b"m").await;
            assert!(confirm.await.unwrap().is_ack());
        }
        let (cc, cch, mut c) = consumer(&nodes[2], "c", 50).await;
        for _ in 0..100 {
            let d = c.next().await.unwrap().unwrap();
            d.ack(BasicAckOptions::default()).await.unwrap();
        }
        (pc, pch, cc, cch, c)
    });
    for i in [2, 1, 0] {
        nodes[i].terminate();
    }
    drop(clients);
    let logged: Vec<String> = nodes.iter().flat_map(peers::warnings).collect();
    assert!(logged.is_empty(), "{logged:#?}");
}

#[test]
fn deleting_mirrored_queues_logs_no_warning() {
    // Deleting a mirrored queue (a synchronised one holding messages, and
    // fresh ones declared and deleted at once) is no fault: its mirrors see
    // the master leave just before the deletion reaches them, and say so
    // at info only.
    peers::use_default_logs();
    let root = peers::test_root();
    let (_secret, mut nodes, rt) = mirrored_three(root.path());
    rt.block_on(async {
        let (_pc, pch) = confirming(&nodes[1]).await;
        for _ in 0..20 {
            let confirm = publish_persistent(&pch, QUEUE, b"m").await;
            assert!(confirm.await.unwrap().is_ack());
        }
        let conn = connect(&nodes[2]).await;
        let ch = conn.create_channel().await.unwrap();
        ch.queue_delete(QUEUE.into(), QueueDeleteOptions::default())
            .await
            .unwrap();
        for i in 0..12u64 {
            let name = format!("ha.brief-{i}");
            ch.queue_declare(
                name.as_str().into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await
            .unwrap();
            // Deleted before, while or after its mirrors start.
            tokio::time::sleep(Duration::from_millis(i * 25)).await;
            ch.queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                .await
                .unwrap();
        }
    });
    // Longer than a mirror waits before it warns of a missing master.
    std::thread::sleep(Duration::from_secs(7));
    let running: Vec<String> = nodes.iter().flat_map(peers::warnings).collect();
    assert!(running.is_empty(), "{running:#?}");
    for i in [2, 1, 0] {
        nodes[i].terminate();
    }
}

/// Many mirrored queues fail over together: 150 queues mastered on A, each
/// holding 10 confirmed persistent messages, and A SIGKILLed. Every queue
/// gets a master among the survivors and keeps all its messages, and each
/// is consumed through B.
#[test]
fn many_mirrored_queues_fail_over_together_when_their_masters_node_dies() {
    const QUEUES: usize = 150;
    const EACH: usize = 10;
    let root = peers::test_root();
    let (_secret, mut nodes) = three(root.path());
    set_ha_all(&nodes[0]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let name = |i: usize| format!("ha.many.{i}");
    let acked: BTreeSet<String> = rt.block_on(async {
        let (conn, ch) = confirming(&nodes[0]).await;
        let opts = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        for i in 0..QUEUES {
            ch.queue_declare(name(i).as_str().into(), opts, FieldTable::default())
                .await
                .unwrap();
        }
        let messages =
            (0..QUEUES).flat_map(|i| (0..EACH).map(move |k| (name(i), format!("{i}/{k}"))));
        let acked = publish_each(&ch, messages).await;
        let _ = conn.close(200, "bye".into()).await;
        acked
    });
    assert_eq!(
        acked.len(),
        QUEUES * EACH,
        "every publish confirmed while all are up"
    );
    let listed = |p: &Peer| -> Vec<Value> {
        p.get("/api/queues/%2F")
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|q| {
                q["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("ha.many."))
            })
            .collect()
    };
    peers::eventually_within(
        "every queue with two synchronised mirrors",
        Duration::from_secs(60),
        || {
            let qs = listed(&nodes[0]);
            qs.len() == QUEUES
                && qs
                    .iter()
                    .all(|q| names(q, "synchronised_slave_nodes").len() == 2)
        },
    );

    nodes[0].kill();
    peers::eventually_within(
        "every queue mastered by a survivor with all its messages",
        Duration::from_secs(60),
        || {
            let qs = listed(&nodes[1]);
            qs.len() == QUEUES
                && qs.iter().all(|q| {
                    (q["node"] == "warren@b" || q["node"] == "warren@c")
                        && q["messages"] == EACH as u64
                })
        },
    );
    let seen: BTreeSet<String> = rt.block_on(async {
        let conn = connect(&nodes[1]).await;
        let ch = conn.create_channel().await.unwrap();
        let mut seen = BTreeSet::new();
        for i in 0..QUEUES {
            while let Some(m) = ch
                .basic_get(name(i).as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap()
            {
                seen.insert(String::from_utf8_lossy(&m.delivery.data).into_owned());
            }
        }
        let _ = conn.close(200, "bye".into()).await;
        seen
    });
    let lost: Vec<&String> = acked.difference(&seen).collect();
    assert!(
        lost.is_empty(),
        "confirmed messages lost: {} ({:?}…)",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
}

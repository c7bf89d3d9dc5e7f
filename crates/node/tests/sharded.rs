//! A node of two shards (`--shards 2`), driven by lapin: queues live on the
//! shard of the connection that declared them, and every connection works
//! with every queue whichever shard it is on; confirmed persistent messages
//! survive a SIGKILL on both shards; a data directory refuses another shard
//! count.

mod common;

use std::process::{Command, Stdio};

use common::{Node, within};
use futures::StreamExt as _;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};

const SHARDS: &[&str] = &["--shards", "2"];

/// Connections in a row: clients are given to the shards in turn, so two in
/// a row are on different shards.
async fn connections(node: &Node, n: usize) -> Vec<Connection> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(node.connect().await);
    }
    out
}

async fn confirmed_channel(conn: &Connection) -> Channel {
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    ch
}

async fn declare_durable(ch: &Channel, queue: &str) {
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("declare");
}

async fn count(conn: &Connection, queue: &str) -> u32 {
    let ch = conn.create_channel().await.expect("channel");
    let n = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::default().passive(),
            FieldTable::default(),
        )
        .await
        .expect("passive declare")
        .message_count();
    ch.close(200, "bye".into()).await.expect("close");
    n
}

/// Publishes `n` persistent messages through `exchange` with routing key
/// `key`, each confirmed.
async fn publish(ch: &Channel, exchange: &str, key: &str, n: usize) {
    for i in 0..n {
        let confirm = ch
            .basic_publish(
                exchange.into(),
                key.into(),
                BasicPublishOptions::default(),
                format!("{key}-{i}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .expect("publish");
        assert!(
            confirm.await.expect("confirm").is_ack(),
            "a publish was nacked"
        );
    }
}

#[tokio::test]
async fn every_connection_serves_the_queues_of_every_shard() {
    let dir = tempfile::tempdir().expect("tempdir");
    let node = Node::start(dir.path(), SHARDS);
    within(async {
        let conns = connections(&node, 4).await;
        // Each connection declares its own queue, on its own shard, and
        // binds it to a fanout exchange.
        let mut chans = Vec::new();
        for (i, c) in conns.iter().enumerate() {
            let ch = confirmed_channel(c).await;
            declare_durable(&ch, &format!("q{i}")).await;
            chans.push(ch);
        }
        chans[0]
            .exchange_declare(
                "fan".into(),
                ExchangeKind::Fanout,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("exchange.declare");
        for (i, ch) in chans.iter().enumerate() {
            ch.queue_bind(
                format!("q{i}").as_str().into(),
                "fan".into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind");
        }
        // Every connection publishes into every queue, directly and through
        // the exchange declared on another shard.
        for ch in &chans {
            for q in 0..4 {
                publish(ch, "", &format!("q{q}"), 25).await;
            }
            publish(ch, "fan", "via-fan", 5).await;
        }
        for c in &conns {
            for q in 0..4 {
                assert_eq!(count(c, &format!("q{q}")).await, 4 * 25 + 4 * 5);
            }
        }
        // The management API shows the node as one: the connections of
        // both shards, each queue's figures as its own shard has them.
        let listed = node.api("/api/connections");
        assert_eq!(listed.as_array().map(Vec::len), Some(4), "{listed}");
        let overview = node.api("/api/overview");
        assert_eq!(overview["object_totals"]["connections"], 4, "{overview}");
        assert_eq!(overview["queue_totals"]["messages"], 4 * 120, "{overview}");
        for q in node.api("/api/queues").as_array().expect("a list") {
            assert_eq!(q["messages"], 120, "{q}");
        }
        // Each queue is drained by the next connection (the other shard),
        // acking each delivery, in the order its publisher sent them.
        for (i, c) in conns.iter().enumerate() {
            let queue = format!("q{}", (i + 1) % 4);
            let ch = c.create_channel().await.expect("channel");
            let mut consumer = ch
                .basic_consume(
                    queue.as_str().into(),
                    "drain".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .expect("consume");
            let mut got = Vec::new();
            while got.len() < 120 {
                let d = consumer
                    .next()
                    .await
                    .expect("a delivery")
                    .expect("delivery");
                got.push(String::from_utf8(d.data.clone()).expect("utf-8"));
                d.ack(BasicAckOptions::default()).await.expect("ack");
            }
            let first_publisher: Vec<&String> = got.iter().take(30).collect();
            let want: Vec<String> = (0..25)
                .map(|k| format!("{queue}-{k}"))
                .chain((0..5).map(|k| format!("via-fan-{k}")))
                .collect();
            assert_eq!(first_publisher, want.iter().collect::<Vec<_>>());
            assert_eq!(count(c, &queue).await, 0, "{queue} drained");
        }
        // A get through another shard, with a no-ack and an ack.
        publish(&chans[1], "", "q0", 2).await;
        let ch = conns[1].create_channel().await.expect("channel");
        let m = ch
            .basic_get("q0".into(), BasicGetOptions { no_ack: true })
            .await
            .expect("get")
            .expect("a message");
        assert_eq!(m.delivery.data, b"q0-0");
        let m = ch
            .basic_get("q0".into(), BasicGetOptions { no_ack: false })
            .await
            .expect("get")
            .expect("a message");
        m.delivery
            .ack(BasicAckOptions::default())
            .await
            .expect("ack");
        assert_eq!(count(&conns[2], "q0").await, 0);
        // The management API's own client (on shard 0) publishes to and
        // gets from shard 1's queue.
        let routed = node.api_post(
            "/api/exchanges/%2F/amq.default/publish",
            &serde_json::json!({"routing_key": "q1", "payload": "web",
                "payload_encoding": "string", "properties": {}}),
        );
        assert_eq!(routed["routed"], true, "{routed}");
        let got = node.api_post(
            "/api/queues/%2F/q1/get",
            &serde_json::json!({"count": 1, "ackmode": "ack_requeue_false",
                "encoding": "auto"}),
        );
        assert_eq!(got[0]["payload"], "web", "{got}");
        // The management API names each queue's shard.
        let queues = node.api("/api/queues");
        let nodes: Vec<&str> = queues
            .as_array()
            .expect("a list")
            .iter()
            .map(|q| q["node"].as_str().unwrap_or_default())
            .collect();
        assert!(nodes.contains(&"warren@localhost"), "{nodes:?}");
        assert!(nodes.contains(&"warren@localhost/shard1"), "{nodes:?}");
    })
    .await;
}

#[tokio::test]
async fn confirmed_messages_on_both_shards_survive_a_sigkill() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = Node::start(dir.path(), SHARDS);
    within(async {
        let conns = connections(&node, 2).await;
        for (i, c) in conns.iter().enumerate() {
            let ch = confirmed_channel(c).await;
            declare_durable(&ch, &format!("d{i}")).await;
        }
        // Each connection publishes into both queues: its own shard's and
        // the other's.
        for c in &conns {
            let ch = confirmed_channel(c).await;
            publish(&ch, "", "d0", 50).await;
            publish(&ch, "", "d1", 50).await;
        }
    })
    .await;
    node.kill();
    let node = Node::start(dir.path(), SHARDS);
    within(async {
        let conns = connections(&node, 2).await;
        for c in &conns {
            assert_eq!(count(c, "d0").await, 100);
            assert_eq!(count(c, "d1").await, 100);
        }
    })
    .await;
    drop(node);
    // The queues live on two shards: one shard alone would lose d1.
    let out = Command::new(env!("CARGO_BIN_EXE_warren"))
        .args(["--amqp-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .expect("run warren");
    assert!(
        !out.status.success(),
        "a sharded data directory ran unsharded"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--shards"), "{err}");
}

#[tokio::test]
async fn an_exclusive_queue_is_gone_on_every_shard_once_its_client_closed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let node = Node::start(dir.path(), SHARDS);
    within(async {
        for round in 0..20 {
            // The owner on one shard, the next client on the other.
            let conns = connections(&node, 2).await;
            let [owner, next] = &conns[..] else {
                unreachable!("two connections")
            };
            let ch = owner.create_channel().await.expect("channel");
            ch.queue_declare(
                "mine".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare");
            owner.close(200, "bye".into()).await.expect("close");
            let ch = next.create_channel().await.expect("channel");
            let err = ch
                .queue_declare(
                    "mine".into(),
                    QueueDeclareOptions::default().passive(),
                    FieldTable::default(),
                )
                .await
                .expect_err("the queue went with its connection");
            assert_eq!(common::code(&err), Some(404), "round {round}: {err}");
            next.close(200, "bye".into()).await.expect("close");
        }
    })
    .await;
}

#[tokio::test]
async fn clients_of_another_shards_queue_move_there_and_keep_the_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    let node = Node::start(dir.path(), SHARDS);
    within(async {
        // The queue on shard 0; a publisher and a consumer given to shard 1,
        // each moving to shard 0 at its first command naming the queue.
        let conns = connections(&node, 4).await;
        declare_durable(&conns[0].create_channel().await.expect("channel"), "mq").await;
        let consumer_ch = conns[3].create_channel().await.expect("channel");
        let mut consumer = consumer_ch
            .basic_consume(
                "mq".into(),
                "moved".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("consume");
        let publisher = confirmed_channel(&conns[1]).await;
        publish(&publisher, "", "mq", 300).await;
        for i in 0..300 {
            let d = consumer
                .next()
                .await
                .expect("a delivery")
                .expect("delivery");
            assert_eq!(d.data, format!("mq-{i}").as_bytes(), "delivery {i}");
            d.ack(BasicAckOptions::default()).await.expect("ack");
        }
        assert_eq!(count(&conns[2], "mq").await, 0);
        let consumers = node.api("/api/consumers");
        assert_eq!(consumers.as_array().map(Vec::len), Some(1), "{consumers}");
    })
    .await;
}

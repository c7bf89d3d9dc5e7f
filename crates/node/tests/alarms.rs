//! Resource alarms against real `warren` processes and lapin clients: over
//! the memory high watermark or under the disk free limit, publishers get
//! `connection.blocked` and wait while consumers drain; when the alarm
//! clears they get `connection.unblocked` and their messages go through.
//! The limits are moved with the management API (`warrenctl
//! set_vm_memory_high_watermark` / `set_disk_free_limit`) so that the
//! test's alarms come and go without filling the machine.

mod peers;

use std::time::Duration;

use futures::{Stream, StreamExt as _};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties, Event};
use peers::{Peer, eventually, test_root, three};
use serde_json::{Value, json};

const QUEUE: &str = "alarm.q";

async fn connect(p: &Peer) -> Connection {
    Connection::connect(&p.amqp_url(), ConnectionProperties::default())
        .await
        .expect("connect")
}

/// A connection to `p` with a confirming channel; declares the durable queue.
async fn publisher(p: &Peer) -> (Connection, lapin::Channel) {
    let conn = connect(p).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    ch.queue_declare(
        QUEUE.into(),
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    (conn, ch)
}

/// Waits (at most 30 s) for the next blocked/unblocked event.
async fn next_block_event(events: &mut (impl Stream<Item = Event> + Unpin)) -> Event {
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let e = events.next().await.expect("events end");
            if matches!(e, Event::ConnectionBlocked(_) | Event::ConnectionUnblocked) {
                return e;
            }
        }
    })
    .await
    .expect("no connection.blocked/unblocked within 30 s")
}

fn put(p: &Peer, path: &str, body: &Value) {
    let (status, v) = p.http("PUT", path, Some(body));
    assert_eq!(status, 204, "PUT {path} {body}: {v}");
}

fn health(p: &Peer, check: &str) -> (u16, Value) {
    p.http("GET", &format!("/api/health/checks/{check}"), None)
}

async fn publish(ch: &lapin::Channel, body: &str) -> lapin::PublisherConfirm {
    ch.basic_publish(
        "".into(),
        QUEUE.into(),
        BasicPublishOptions::default(),
        body.as_bytes(),
        BasicProperties::default().with_delivery_mode(2),
    )
    .await
    .expect("publish")
}

/// Publishes `body` in a task and waits for its confirm there: a blocked
/// connection does not even send it (lapin holds its writes while blocked).
fn publish_confirmed(
    ch: &lapin::Channel,
    body: &'static str,
) -> tokio::task::JoinHandle<lapin::Result<lapin::Confirmation>> {
    let ch = ch.clone();
    tokio::spawn(async move { publish(&ch, body).await.await })
}

/// Receives `n` messages from `consumer`, acks them, returns their bodies.
async fn drain(consumer: &mut lapin::Consumer, n: usize) -> Vec<String> {
    let mut got = Vec::new();
    while got.len() < n {
        let d = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await
            .expect("a delivery within 30 s")
            .expect("consumer open")
            .expect("delivery");
        got.push(String::from_utf8_lossy(&d.data).into_owned());
        d.ack(BasicAckOptions::default()).await.expect("ack");
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_and_disk_alarms_block_publishers_and_let_consumers_drain() {
    let root = test_root();
    let secret = root.path().join("secret");
    std::fs::write(&secret, "alarms-secret\n").unwrap();
    let a = Peer::start("warren@a", &root.path().join("a"), &secret, None);
    let node_path = format!("/api/nodes/{}", a.name.replace('@', "%40"));

    let (pconn, pch) = publisher(&a).await;
    let mut events = Box::pin(pconn.events_listener());
    for i in 0..5 {
        publish(&pch, &format!("before-{i}"))
            .await
            .await
            .expect("confirm");
    }
    let cconn = connect(&a).await;
    let cch = cconn.create_channel().await.unwrap();

    // Memory: a 1-byte watermark raises the alarm at once.
    put(
        &a,
        &format!("{node_path}/memory_high_watermark"),
        &json!({"absolute": 1}),
    );
    let n = a.get(&node_path);
    assert_eq!(n["mem_alarm"], true, "{n}");
    assert_eq!(n["mem_limit"], 1, "{n}");
    let (status, v) = health(&a, "alarms");
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["alarms"][0]["resource"], "memory", "{v}");
    assert_eq!(health(&a, "local-alarms").0, 503);

    // The publisher's next publish blocks it; the consumer drains.
    let during = publish_confirmed(&pch, "during-memory-alarm");
    match next_block_event(&mut events).await {
        Event::ConnectionBlocked(reason) => assert_eq!(reason, "low on memory"),
        e => panic!("expected connection.blocked, got {e:?}"),
    }
    let mut consumer = cch
        .basic_consume(
            QUEUE.into(),
            "drainer".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let got = drain(&mut consumer, 5).await;
    assert_eq!(
        got,
        (0..5).map(|i| format!("before-{i}")).collect::<Vec<_>>()
    );

    // Raised again: unblocked, the held publish is confirmed and delivered.
    put(
        &a,
        &format!("{node_path}/memory_high_watermark"),
        &json!({"relative": 0.9}),
    );
    match next_block_event(&mut events).await {
        Event::ConnectionUnblocked => {}
        e => panic!("expected connection.unblocked, got {e:?}"),
    }
    during
        .await
        .unwrap()
        .expect("confirmed after the alarm cleared");
    assert_eq!(drain(&mut consumer, 1).await, ["during-memory-alarm"]);
    assert_eq!(health(&a, "alarms").0, 200);

    // Disk: a limit above any free space raises the disk alarm.
    put(
        &a,
        &format!("{node_path}/disk_free_limit"),
        &json!({"absolute": "1000000TB"}),
    );
    assert_eq!(a.get(&node_path)["disk_free_alarm"], true);
    let held = publish_confirmed(&pch, "during-disk-alarm");
    match next_block_event(&mut events).await {
        Event::ConnectionBlocked(reason) => assert_eq!(reason, "low on disk"),
        e => panic!("expected connection.blocked, got {e:?}"),
    }
    let (status, v) = health(&a, "alarms");
    assert_eq!((status, &v["alarms"][0]["resource"]), (503, &json!("disk")));
    put(
        &a,
        &format!("{node_path}/disk_free_limit"),
        &json!({"absolute": "50MB"}),
    );
    assert!(matches!(
        next_block_event(&mut events).await,
        Event::ConnectionUnblocked
    ));
    held.await
        .unwrap()
        .expect("confirmed after the disk alarm cleared");
    assert_eq!(drain(&mut consumer, 1).await, ["during-disk-alarm"]);

    // Bad values are refused with the reason.
    let (status, v) = a.http(
        "PUT",
        &format!("{node_path}/disk_free_limit"),
        Some(&json!({"absolute": "lots"})),
    );
    assert_eq!(status, 400, "{v}");
    assert!(
        v["reason"].as_str().unwrap_or("").contains("is not a size"),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alarm_on_one_node_blocks_publishers_on_every_node() {
    let root = test_root();
    let (_secret, nodes) = three(root.path());
    let (a, b) = (&nodes[0], &nodes[1]);
    let a_path = format!("/api/nodes/{}", a.name.replace('@', "%40"));

    let (pconn, pch) = publisher(b).await;
    let mut events = Box::pin(pconn.events_listener());
    publish(&pch, "first").await.await.expect("confirm");

    put(
        a,
        &format!("{a_path}/memory_high_watermark"),
        &json!({"absolute": 1}),
    );
    // B learns of A's alarm over the link and says so.
    eventually("B reports A's memory alarm", || {
        let (status, v) = health(b, "alarms");
        status == 503 && v["alarms"][0]["node"] == a.name.as_str()
    });
    assert_eq!(health(b, "local-alarms").0, 200, "B itself is fine");
    let held = publish_confirmed(&pch, "second");
    match next_block_event(&mut events).await {
        Event::ConnectionBlocked(reason) => assert_eq!(reason, "low on memory"),
        e => panic!("expected connection.blocked, got {e:?}"),
    }
    put(
        a,
        &format!("{a_path}/memory_high_watermark"),
        &json!({"relative": 0.9}),
    );
    assert!(matches!(
        next_block_event(&mut events).await,
        Event::ConnectionUnblocked
    ));
    held.await
        .unwrap()
        .expect("confirmed once A's alarm cleared");
    assert_eq!(health(b, "alarms").0, 200);
}

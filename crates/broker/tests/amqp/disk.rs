//! A durable queue whose log failed (a full or failing disk): the
//! publishes waiting for their group commit are nacked, never left
//! unanswered; the queue nacks publishes while it is held; once its log
//! opens again (the node's shell tries every second) it serves every
//! message confirmed before, marked redelivered, and confirms again
//! (`broker/persistence.rs`).

use std::sync::Arc;

use warren_amqp::amq_protocol::protocol::{AMQPClass, basic, queue};
use warren_amqp::amq_protocol::types::AMQPValue;
use warren_backing_queue::MemStorage;

use crate::confirms::{confirming, confirms};
use crate::support::{Client, Message, Node, QueueOpts};

/// The confirms received so far: (kind, delivery tag).
fn answers(c: &mut Client) -> Vec<(&'static str, u64)> {
    confirms(c)
        .iter()
        .map(|&(kind, tag, _)| (kind, tag))
        .collect()
}

/// Every message of queue `name`, taken with basic.get (no-ack): body and
/// redelivered flag.
fn take_all(c: &mut Client, name: &str) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    loop {
        let got = c.get(1, name, true).expect("basic.get");
        let AMQPClass::Basic(basic::AMQPMethod::GetOk(ok)) = &got.method else {
            return out;
        };
        out.push((
            String::from_utf8_lossy(&got.body).into_owned(),
            ok.redelivered,
        ));
    }
}

/// Opens the failed log of the node's one failed queue, as the node's
/// shell does (`crates/node/src/failed_logs.rs`); false if it does not open.
fn reopen(node: &Node) -> bool {
    let plans = node.with_broker(warren_broker::Broker::failed_logs);
    assert_eq!(plans.len(), 1, "{plans:?}");
    match plans[0].open() {
        Ok((bq, _)) => node.with_broker(|b| b.reopened(&plans[0], bq)),
        Err(_) => false,
    }
}

#[test]
fn a_failed_commit_nacks_its_publishes_and_the_queue_serves_again_once_its_log_opens() {
    let storage = Arc::new(MemStorage::new());
    let node = Node::on_storage(storage.clone());
    let mut c = confirming(&node);
    c.declare_queue(1, "d", QueueOpts::durable()).unwrap();
    c.publish(1, "", "d", Message::persistent("kept"));
    node.sync();
    assert_eq!(answers(&mut c), [("ack", 1)]);

    storage.set_failing(true);
    c.publish(1, "", "d", Message::persistent("lost"));
    assert_eq!(answers(&mut c), [], "confirmed before its commit");
    node.sync();
    assert_eq!(answers(&mut c), [("nack", 2)], "the commit failed");
    // Held: a publish is nacked at once, a get finds nothing.
    c.publish(1, "", "d", Message::persistent("refused"));
    assert_eq!(answers(&mut c), [("nack", 3)]);
    assert_eq!(take_all(&mut c, "d"), []);
    assert!(!reopen(&node), "opened while the disk fails");

    storage.set_failing(false);
    assert!(reopen(&node), "not opened once the disk works");
    assert!(
        node.with_broker(warren_broker::Broker::failed_logs)
            .is_empty()
    );
    c.publish(1, "", "d", Message::persistent("after"));
    node.sync();
    assert_eq!(answers(&mut c), [("ack", 4)]);
    // What was confirmed is there, marked delivered (the marks in memory
    // went with the failed copy); what was nacked never reached the disk.
    assert_eq!(
        take_all(&mut c, "d"),
        [("kept".to_owned(), true), ("after".to_owned(), false)]
    );
}

#[test]
fn a_publish_the_log_cannot_write_is_nacked_and_the_connection_stays() {
    let storage = Arc::new(MemStorage::new());
    let node = Node::on_storage(storage.clone());
    let mut c = confirming(&node);
    c.declare_queue(1, "d", QueueOpts::durable()).unwrap();
    storage.set_failing(true);
    // A large body (100 KB, one frame) goes to the file at once, and fails.
    let big = "x".repeat(100_000);
    c.publish(1, "", "d", Message::persistent(&big));
    assert_eq!(answers(&mut c), [("nack", 1)]);
    storage.set_failing(false);
    assert!(reopen(&node));
    c.publish(1, "", "d", Message::persistent("after"));
    node.sync();
    assert_eq!(answers(&mut c), [("ack", 2)]);
    assert_eq!(take_all(&mut c, "d"), [("after".to_owned(), false)]);
}

/// A durable lazy queue (bodies on disk only) holding one confirmed
/// message, "kept", on a storage whose reads then fail.
fn lazy_queue_with_reads_failing() -> (Arc<MemStorage>, Node, Client) {
    let storage = Arc::new(MemStorage::new());
    let node = Node::on_storage(storage.clone());
    let mut c = confirming(&node);
    let lazy = QueueOpts::durable().arg("x-queue-mode", AMQPValue::LongString("lazy".into()));
    c.declare_queue(1, "d", lazy).unwrap();
    c.publish(1, "", "d", Message::persistent("kept"));
    node.sync();
    assert_eq!(answers(&mut c), [("ack", 1)]);
    storage.set_failing_reads(true);
    (storage, node, c)
}

#[test]
fn a_get_the_log_cannot_read_holds_the_queue_until_its_log_opens() {
    let (storage, node, mut c) = lazy_queue_with_reads_failing();
    // The read fails: the queue is held, its get empty.
    assert_eq!(take_all(&mut c, "d"), []);
    assert!(!reopen(&node), "opened while reads fail");
    storage.set_failing_reads(false);
    assert!(reopen(&node));
    assert_eq!(take_all(&mut c, "d"), [("kept".to_owned(), true)]);
}

#[test]
fn a_delivery_the_log_cannot_read_holds_the_queue_until_its_log_opens() {
    let (storage, node, mut c) = lazy_queue_with_reads_failing();
    c.consume(1, "d", "reader", true);
    assert!(
        !c.drain().iter().any(|i| i.ids() == (60, 60)),
        "a delivery read from a failing disk"
    );
    storage.set_failing_reads(false);
    assert!(reopen(&node));
    // The consumer waited and now gets the message, marked delivered.
    let deliveries: Vec<bool> = c
        .drain()
        .iter()
        .filter_map(|i| match &i.method {
            AMQPClass::Basic(basic::AMQPMethod::Deliver(d)) => Some(d.redelivered),
            _ => None,
        })
        .collect();
    assert_eq!(deliveries, [true]);
}

#[test]
fn a_failed_queue_deleted_and_declared_again_is_not_replaced_by_the_old_log() {
    let storage = Arc::new(MemStorage::new());
    let node = Node::on_storage(storage.clone());
    let mut c = confirming(&node);
    c.declare_queue(1, "d", QueueOpts::durable()).unwrap();
    storage.set_failing(true);
    c.publish(1, "", "d", Message::persistent("lost"));
    node.sync();
    assert_eq!(answers(&mut c), [("nack", 1)]);
    let plans = node.with_broker(warren_broker::Broker::failed_logs);
    assert_eq!(plans.len(), 1);
    storage.set_failing(false);
    let delete = AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
        queue: "d".into(),
        if_unused: false,
        if_empty: false,
        nowait: false,
    }));
    c.call(1, delete).expect("queue.delete");
    c.declare_queue(1, "d", QueueOpts::durable()).unwrap();
    c.publish(1, "", "d", Message::persistent("new"));
    node.sync();
    assert_eq!(answers(&mut c), [("ack", 2)]);
    // Nothing to open for the new declaration, and the plan made before
    // the delete is refused.
    assert!(
        node.with_broker(warren_broker::Broker::failed_logs)
            .is_empty()
    );
    let (bq, _) = plans[0].open().expect("opens");
    assert!(!node.with_broker(|b| b.reopened(&plans[0], bq)));
    assert_eq!(take_all(&mut c, "d"), [("new".to_owned(), false)]);
}

//! When a durable queue's group commit is asked for (`broker/persistence.rs`):
//! what a publisher waits for at once; acks and delivery marks, which
//! nobody waits for, within 100 ms, so that a crash soon after does not
//! deliver again what was already taken.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::support::{Message, Node, QueueOpts, START_MS};

#[test]
fn a_no_ack_get_alone_asks_for_a_group_commit_within_100_ms_and_survives_a_restart() {
    let node = Node::durable();
    let asked = Arc::new(AtomicUsize::new(0));
    let a = asked.clone();
    node.with_broker(|b| {
        b.set_sync_waker(Arc::new(move || {
            a.fetch_add(1, Ordering::SeqCst);
        }));
    });
    let mut c = node.connect();
    c.open_channel(1);
    c.declare_queue(1, "d", QueueOpts::durable())
        .expect("declare");
    c.publish(1, "", "d", Message::persistent("one"));
    c.publish(1, "", "d", Message::persistent("two"));
    node.sync();
    let before = asked.load(Ordering::SeqCst);
    // Taken with no ack to come: the removal is owed to the disk.
    assert_eq!(c.get_body(1, "d").as_deref(), Some(&b"one"[..]));
    node.tick(START_MS + 150);
    assert!(
        asked.load(Ordering::SeqCst) > before,
        "the get's ack asked for no group commit"
    );
    node.sync();
    drop(c);
    node.restart();
    let mut c = node.connect();
    c.open_channel(1);
    assert_eq!(c.counts(1, "d"), (1, 0), "the message taken came back");
}

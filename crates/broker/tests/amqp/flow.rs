//! Flow control (`Broker::input_paused`, `broker/mirrored.rs`): a queue
//! whose consumers are taking messages holds its publishers back while
//! more than [`FLOW_READY_MAX`] messages are ready, so that consumers keep
//! pace with what is accepted; a queue nobody consumes from, or whose
//! consumers went idle, holds nobody back.

use warren_broker::FLOW_READY_MAX;

use crate::support::{Message, Node, START_MS};

#[test]
fn a_lagging_consumer_holds_its_queues_publishers_back() {
    let node = Node::new();
    let mut publisher = node.connect();
    publisher.open_channel(1);
    publisher.queue(1, "q");
    let mut consumer = node.connect();
    consumer.open_channel(1);
    consumer.qos(1, 1, false);
    consumer.consume(1, "q", "ctag", false);
    let mut other = node.connect();
    other.open_channel(1);
    other.queue(1, "other");

    // The consumer takes the first message and keeps it unacked: the rest
    // stay ready.
    let ready = usize::try_from(FLOW_READY_MAX).unwrap();
    for i in 0..=ready {
        publisher.publish(1, "", "q", Message::new(&format!("m{i}")));
    }
    assert_eq!(consumer.drain().len(), 1);
    assert!(
        !publisher.input_paused(),
        "{ready} ready is not over the limit"
    );
    publisher.publish(1, "", "q", Message::new("one more"));
    assert!(
        publisher.input_paused(),
        "over the limit: the publisher waits"
    );
    // Only this queue's publishers wait; consumers never do.
    assert!(!consumer.input_paused());
    other.publish(1, "", "other", Message::new("elsewhere"));
    assert!(!other.input_paused());

    // Each ack lets one more message go: one takes the queue under the limit.
    consumer.ack(1, 1, false);
    assert_eq!(consumer.drain().len(), 1);
    assert!(!publisher.input_paused(), "under the limit again");
    publisher.publish(1, "", "q", Message::new("again over"));
    assert!(publisher.input_paused());

    // A consumer that took nothing for a second is idle: the queue then
    // grows as RabbitMQ's does.
    node.tick(START_MS + 1_001);
    assert!(!publisher.input_paused());
}

#[test]
fn a_queue_without_consumers_holds_nobody_back() {
    let (_node, mut publisher) = Node::session();
    publisher.queue(1, "q");
    for i in 0..4 * FLOW_READY_MAX {
        publisher.publish(1, "", "q", Message::new(&format!("m{i}")));
    }
    assert!(!publisher.input_paused());
}

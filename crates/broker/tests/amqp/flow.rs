//! Flow control (`Broker::input_paused`, `broker/mirrored.rs`): a queue
//! whose consumers are taking messages holds its publishers back while
//! more than [`FLOW_READY_MAX`] messages are ready, so that consumers keep
//! pace with what is accepted; a queue nobody consumes from, or whose
//! consumers went idle, holds nobody back. A queue served on another node
//! holds its publishers back while the link to that node is behind.

use warren_broker::{FLOW_READY_MAX, LINK_BEHIND_MAX};

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

#[test]
fn a_link_that_is_behind_holds_back_the_publishers_that_send_through_it() {
    let node = Node::new();
    let mut remote = node.connect();
    remote.open_channel(1);
    remote.queue(1, "far");
    remote.queue(1, "near");
    // "far" is served by node n2: its publishes are forwarded there.
    node.with_broker(|b| b.set_queue_master("/", "far", Some("n2")));
    let mut local = node.connect();
    local.open_channel(1);

    for i in 0..LINK_BEHIND_MAX {
        remote.publish(1, "", "far", Message::new(&format!("m{i}")));
    }
    assert!(
        !remote.input_paused(),
        "{LINK_BEHIND_MAX} waiting is not over the limit"
    );
    remote.publish(1, "", "far", Message::new("one more"));
    assert!(
        remote.input_paused(),
        "the link to n2 is behind: its publisher waits"
    );
    // A publisher into a queue served here does not wait for n2's link.
    local.publish(1, "", "near", Message::new("here"));
    assert!(!local.input_paused());

    // Handed to the shell is not written: the publisher still waits …
    let out = node.with_broker(warren_broker::Broker::take_link_out);
    let handed: usize = out.iter().map(|(_, m)| m.len()).sum();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, "n2");
    assert!(remote.input_paused());
    // … until the shell wrote (or gave up) what it took.
    node.with_broker(|b| b.link_sent("n2", handed - 1));
    assert!(!remote.input_paused());
}

//! Flow control (`Broker::input_paused`, `broker/mirrored.rs`): a queue
//! whose consumers are taking messages holds its publishers back while
//! more than [`FLOW_READY_MAX`] messages are ready, so that consumers keep
//! pace with what is accepted; a queue nobody consumes from, or whose
//! consumers went idle, holds nobody back. A queue served on another node
//! holds its publishers back while the link to that node is behind. A
//! consumer that acks but trails its deliveries by more than
//! [`CONSUMER_BEHIND_MAX`] gets no more until it catches up, whatever its
//! prefetch, so that its backlog stays in the queue, where flow control sees
//! it.

use warren_broker::{
    CONSUMER_ACKING_MS, CONSUMER_BEHIND_MAX, FLOW_READY_BYTES_MAX, FLOW_READY_MAX, LINK_BEHIND_MAX,
    LINK_PUBLISHES_MAX, LinkMsg,
};

use crate::support::{Client, Message, Node, START_MS};

/// A publisher and a consumer with prefetch 1 of queue `q`.
fn prefetch_one_consumer() -> (Node, Client, Client) {
    let node = Node::new();
    let mut publisher = node.connect();
    publisher.open_channel(1);
    publisher.queue(1, "q");
    let mut consumer = node.connect();
    consumer.open_channel(1);
    consumer.qos(1, 1, false);
    consumer.consume(1, "q", "ctag", false);
    (node, publisher, consumer)
}

#[test]
fn a_lagging_consumer_holds_its_queues_publishers_back() {
    let (node, mut publisher, mut consumer) = prefetch_one_consumer();
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
fn large_messages_hold_publishers_back_by_their_bytes() {
    let (_node, mut publisher, mut consumer) = prefetch_one_consumer();
    // Messages of 100,000 bytes (one body frame each): the consumer holds
    // the first; the bytes ready reach the limit before their count does.
    let size = 100_000;
    let large = Message {
        body: vec![7; size],
        ..Message::new("")
    };
    let fit = FLOW_READY_BYTES_MAX / size as u64;
    assert!(fit < FLOW_READY_MAX);
    for _ in 0..=fit {
        publisher.publish(1, "", "q", large.clone());
    }
    assert_eq!(consumer.drain().len(), 1);
    assert!(!publisher.input_paused(), "{fit} ready is not over");
    publisher.publish(1, "", "q", large);
    assert!(publisher.input_paused(), "over by one: the publisher waits");
    consumer.ack(1, 1, false);
    assert_eq!(consumer.drain().len(), 1);
    assert!(!publisher.input_paused(), "under the limit again");
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

    // n2 takes in each batch (`LinkMsg::Taken`), but the shell writes
    // none of them: they stay unsent.
    let mut handed = 0;
    while handed < LINK_BEHIND_MAX {
        for i in 0..(LINK_BEHIND_MAX - handed).min(1_000) {
            remote.publish(1, "", "far", Message::new(&format!("m{i}")));
        }
        handed += take_in(&node, "n2");
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
    let handed = handed + take_in(&node, "n2");
    assert!(remote.input_paused());
    // … until the shell wrote (or gave up) what it took.
    node.with_broker(|b| b.link_sent("n2", handed - 1));
    assert!(!remote.input_paused());
}

/// Hands node `node`'s link messages for `to` to the shell: how many, and
/// the ids of the publishes among them.
fn hand_out(node: &Node, to: &str) -> (usize, Vec<u64>) {
    let out = node.with_broker(warren_broker::Broker::take_link_out);
    let msgs: Vec<&LinkMsg> = out
        .iter()
        .filter(|(n, _)| n == to)
        .flat_map(|(_, m)| m)
        .collect();
    let ids = msgs
        .iter()
        .filter_map(|m| match m {
            LinkMsg::Publish { id, .. } => Some(*id),
            _ => None,
        })
        .collect();
    (msgs.len(), ids)
}

/// [`hand_out`], and `to` takes in the publishes among them; returns how
/// many messages were handed.
fn take_in(node: &Node, to: &str) -> usize {
    let (handed, ids) = hand_out(node, to);
    if let Some(&upto) = ids.last() {
        node.with_broker(|b| b.link_input(to, vec![LinkMsg::Taken { upto }], START_MS));
    }
    handed
}

/// [`hand_out`], and the shell writes them: the publishes' ids.
fn publishes_written(node: &Node, to: &str) -> Vec<u64> {
    let (handed, ids) = hand_out(node, to);
    node.with_broker(|b| b.link_sent(to, handed));
    ids
}

/// A master that holds forwarded publishes back (their queue falls
/// behind) stops reading the link once it holds 4,096, and the acks that
/// came after them on it wait as well: the master then takes the
/// consumers for behind and sends them nothing more, or, once they seem
/// to have stopped acking, all it has (three nodes, a consumer on another
/// node than the queue's master, four publishers: 100–300k delivered and
/// not yet acked as the master saw it, the acks in the link). So an origin
/// keeps at most `LINK_PUBLISHES_MAX` publishes in flight to a node, until
/// it says it took them in.
#[test]
fn publishes_not_yet_taken_in_hold_their_publishers_back() {
    let node = Node::new();
    let mut remote = node.connect();
    remote.open_channel(1);
    remote.queue(1, "far");
    node.with_broker(|b| b.set_queue_master("/", "far", Some("n2")));

    for i in 0..LINK_PUBLISHES_MAX {
        remote.publish(1, "", "far", Message::new(&format!("m{i}")));
    }
    let ids = publishes_written(&node, "n2");
    assert_eq!(ids.len(), LINK_PUBLISHES_MAX);
    assert!(
        !remote.input_paused(),
        "{LINK_PUBLISHES_MAX} in flight is not over the limit"
    );
    remote.publish(1, "", "far", Message::new("one more"));
    let ids: Vec<u64> = ids
        .into_iter()
        .chain(publishes_written(&node, "n2"))
        .collect();
    assert!(
        remote.input_paused(),
        "written, but not taken in by n2: the publisher waits"
    );
    // Taken in up to the first: under the limit again.
    node.with_broker(|b| b.link_input("n2", vec![LinkMsg::Taken { upto: ids[0] }], START_MS));
    assert!(!remote.input_paused());
    remote.publish(1, "", "far", Message::new("over again"));
    let last = *publishes_written(&node, "n2").last().unwrap();
    assert!(remote.input_paused());
    // A lost link loses (or nacks) what was in flight on it: nothing waits
    // for n2 to take it in.
    node.with_broker(|b| b.link_down("n2", START_MS));
    node.with_broker(|b| b.set_queue_master("/", "far", Some("n2")));
    assert!(!remote.input_paused());
    // A late word from the old link changes nothing.
    node.with_broker(|b| b.link_input("n2", vec![LinkMsg::Taken { upto: last }], START_MS));
    assert!(!remote.input_paused());
}

/// A master says, after each batch of link input with publishes in it,
/// the id of the last one it took in, whether it enqueued it or refused it;
/// before that, which it confirmed and which it refused, one message for
/// each run of either.
#[test]
fn a_master_says_up_to_which_publish_it_took_in() {
    let (node, mut client) = Node::session();
    client.queue(1, "q");
    let publish = |queue: &str, id| LinkMsg::Publish {
        vhost: "/".into(),
        queue: queue.into(),
        id,
        publisher: 1,
        first: None,
        meta: bytes::Bytes::new(),
        body: bytes::Bytes::from("m"),
        persistent: false,
        expiration_ms: None,
        priority: 0,
    };
    let batch = vec![publish("q", 7), publish("q", 8), publish("missing", 9)];
    node.with_broker(|b| b.link_input("n2", batch, START_MS));
    let out = node.with_broker(warren_broker::Broker::take_link_out);
    let to_n2: Vec<&LinkMsg> = out
        .iter()
        .filter(|(n, _)| n == "n2")
        .flat_map(|(_, m)| m)
        .collect();
    assert!(
        matches!(
            &to_n2[..],
            [
                LinkMsg::Confirmed { ids: confirmed },
                LinkMsg::Nacked { ids: nacked },
                LinkMsg::Taken { upto: 9 },
            ] if confirmed == &[7, 8] && nacked == &[9]
        ),
        "{to_n2:?}"
    );
    // A batch without publishes says nothing.
    let settle = LinkMsg::Settle {
        vhost: "/".into(),
        tags: vec![],
        how: 0,
    };
    node.with_broker(|b| b.link_input("n2", vec![settle], START_MS));
    let out = node.with_broker(warren_broker::Broker::take_link_out);
    assert!(out.iter().all(|(_, m)| m.is_empty()), "{out:?}");
}

/// A consumer with no prefetch limit that took `sent` deliveries, unacked:
/// the node, the publisher and the consumer.
fn unlimited_consumer(sent: u64) -> (Node, Client, Client) {
    let node = Node::new();
    let mut publisher = node.connect();
    publisher.open_channel(1);
    publisher.queue(1, "q");
    let mut consumer = node.connect();
    consumer.open_channel(1);
    consumer.consume(1, "q", "ctag", false);
    for i in 0..sent {
        publisher.publish(1, "", "q", Message::new(&format!("m{i}")));
    }
    assert_eq!(consumer.drain().len() as u64, sent, "no prefetch limit");
    (node, publisher, consumer)
}

#[test]
fn a_consumer_that_acks_but_falls_behind_gets_no_more_until_it_catches_up() {
    let sent = 2 * CONSUMER_BEHIND_MAX + 88;
    let (_node, mut publisher, mut consumer) = unlimited_consumer(sent);
    // It acks its first delivery: it trails what it was sent by more than
    // the limit, so what comes next stays ready in the queue …
    consumer.ack(1, 1, false);
    let more = FLOW_READY_MAX + 1;
    for i in 0..more {
        publisher.publish(1, "", "q", Message::new(&format!("n{i}")));
    }
    assert!(consumer.drain().is_empty(), "behind: nothing more for now");
    assert_eq!(publisher.counts(1, "q"), (u32::try_from(more).unwrap(), 1));
    // … where flow control sees it: its publisher waits.
    assert!(publisher.input_paused());
    // Acking one by one, it catches up to the limit; from there each ack
    // lets one more message go, as a prefetch window would.
    for tag in 2..sent - CONSUMER_BEHIND_MAX {
        consumer.ack(1, tag, false);
        assert!(consumer.drain().is_empty(), "still behind after {tag}");
    }
    for tag in sent - CONSUMER_BEHIND_MAX..=sent {
        consumer.ack(1, tag, false);
        assert_eq!(consumer.drain().len(), 1, "one more after {tag}");
    }
    assert_eq!(publisher.counts(1, "q"), (0, 1), "all {more} sent");
    assert!(!publisher.input_paused());
}

#[test]
fn a_consumer_that_stops_acking_while_behind_is_sent_messages_again() {
    let sent = CONSUMER_BEHIND_MAX + 2;
    let (node, mut publisher, mut consumer) = unlimited_consumer(sent);
    consumer.ack(1, 1, false);
    publisher.publish(1, "", "q", Message::new("next"));
    assert!(consumer.drain().is_empty(), "behind");
    // It holds the rest unacked (waiting for a batch to fill, say): once
    // it has not acked for a while it is sent messages again.
    node.tick(START_MS + CONSUMER_ACKING_MS - 1);
    assert!(
        consumer.drain().is_empty(),
        "still acking, as far as we know"
    );
    node.tick(START_MS + CONSUMER_ACKING_MS);
    assert_eq!(consumer.drain().len(), 1);
}

#[test]
fn a_consumer_that_acks_what_it_gets_and_keeps_some_unacked_is_not_behind() {
    let sent = 2 * CONSUMER_BEHIND_MAX + 88;
    let (_node, mut publisher, mut consumer) = unlimited_consumer(sent);
    // It acks the even tags as it gets them and keeps the odd ones: more
    // than the limit unacked, but nothing it has not got to.
    for tag in (2..=sent).step_by(2) {
        consumer.ack(1, tag, false);
    }
    publisher.publish(1, "", "q", Message::new("next"));
    assert_eq!(consumer.drain().len(), 1);
    // A batch acked at once (multiple) leaves it behind by nothing.
    consumer.ack(1, sent + 1, true);
    publisher.publish(1, "", "q", Message::new("after the batch"));
    assert_eq!(consumer.drain().len(), 1);
}

#[test]
fn a_consumer_that_is_behind_and_acks_keeps_its_publishers_held_past_a_second() {
    let sent = 2 * CONSUMER_BEHIND_MAX + 88;
    let (node, mut publisher, mut consumer) = unlimited_consumer(sent);
    consumer.ack(1, 1, false);
    for i in 0..=FLOW_READY_MAX {
        publisher.publish(1, "", "q", Message::new(&format!("n{i}")));
    }
    assert!(publisher.input_paused());
    // It gets nothing while it works through what it has, acking every
    // 90 ms: it is taking messages, so its publishers stay held past a
    // second after its last delivery …
    let mut now = START_MS;
    for tag in 2..=17 {
        now += 90;
        node.tick(now);
        consumer.ack(1, tag, false);
    }
    node.tick(START_MS + 1_500);
    assert!(consumer.drain().is_empty());
    assert!(publisher.input_paused());
    // … until it stops acking: then it is sent what is ready, and they go on.
    node.tick(now + CONSUMER_ACKING_MS);
    assert_eq!(consumer.drain().len() as u64, FLOW_READY_MAX + 1);
    assert!(!publisher.input_paused());
}

#[test]
fn a_consumer_that_acks_in_batches_may_trail_by_twice_its_batch() {
    // PerfTest's `--multi-ack-every`: one `multiple` ack every `batch`
    // deliveries, more than the limit. Held at the limit it would never
    // reach its next ack.
    let batch = 3 * CONSUMER_BEHIND_MAX;
    let (_node, mut publisher, mut consumer) = unlimited_consumer(batch);
    consumer.ack(1, batch, true);
    for i in 0..=2 * batch + 1 {
        publisher.publish(1, "", "q", Message::new(&format!("n{i}")));
    }
    // It is sent up to twice its batch beyond its last ack (and one more:
    // the limit is checked before each delivery) …
    assert_eq!(consumer.drain().len() as u64, 2 * batch + 1);
    assert_eq!(publisher.counts(1, "q"), (1, 1), "one left ready");
    // … and its next batch lets the rest go.
    consumer.ack(1, 2 * batch, true);
    assert_eq!(consumer.drain().len(), 1);
}

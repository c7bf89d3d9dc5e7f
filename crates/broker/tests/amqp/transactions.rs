//! Transactions: tx.select, tx.commit, tx.rollback (`broker/command.rs`,
//! `broker/publish.rs`).

use warren_broker::LinkMsg;

use crate::support::{Client, Message, Node, QueueOpts, START_MS};

/// The `(class, method)` ids of everything received so far.
fn ids(c: &mut Client) -> Vec<(u16, u16)> {
    c.drain().iter().map(|i| i.ids()).collect()
}

/// Ready messages in `q` (a passive declare).
fn ready(c: &mut Client, q: &str) -> u32 {
    c.counts(1, q).0
}

#[test]
fn publishes_in_a_transaction_are_routed_at_commit() {
    let (_node, mut c) = Node::session();
    c.queue(1, "q");
    c.open_channel(2);
    c.tx(2, 10);
    assert_eq!(ids(&mut c), [(90, 11)], "tx.select-ok");
    c.publish(2, "", "q", Message::new("a"));
    c.publish(2, "", "q", Message::new("b"));
    assert_eq!(ready(&mut c, "q"), 0, "routed before commit");
    c.tx(2, 20);
    assert_eq!(ids(&mut c), [(90, 21)], "tx.commit-ok");
    assert_eq!(c.get_all(1, "q"), [b"a".to_vec(), b"b".to_vec()]);
}

#[test]
fn rollback_discards_the_publishes_and_the_channel_stays_transactional() {
    let (_node, mut c) = Node::session();
    c.queue(1, "q");
    c.tx(1, 10);
    c.publish(1, "", "q", Message::new("dropped"));
    c.tx(1, 30);
    c.tx(1, 20);
    assert_eq!(ids(&mut c), [(90, 11), (90, 31), (90, 21)]);
    assert_eq!(ready(&mut c, "q"), 0);
    c.publish(1, "", "q", Message::new("kept"));
    assert_eq!(ready(&mut c, "q"), 0, "still transactional");
    c.tx(1, 20);
    assert_eq!(ids(&mut c), [(90, 21)]);
    assert_eq!(c.get_all(1, "q"), [b"kept".to_vec()]);
}

#[test]
fn acks_in_a_transaction_take_effect_at_commit() {
    let (_node, mut c) = Node::session();
    c.queue(1, "q");
    c.publish(1, "", "q", Message::new("m1"));
    c.publish(1, "", "q", Message::new("m2"));
    c.open_channel(2);
    assert_eq!(c.get(2, "q", false).unwrap().body, b"m1");
    assert_eq!(c.get(2, "q", false).unwrap().body, b"m2");
    c.tx(2, 10);
    c.ack(2, 1, false);
    c.tx(2, 30);
    c.ack(2, 2, false);
    c.tx(2, 20);
    assert_eq!(ids(&mut c), [(90, 11), (90, 31), (90, 21)]);
    // The rolled-back ack was not applied: m1 is still unacked and comes
    // back when the channel closes; m2 was acked for good.
    c.close_channel(2);
    assert_eq!(c.get_all(1, "q"), [b"m1".to_vec()]);
}

#[test]
fn commit_ok_for_a_persistent_message_on_a_durable_queue_waits_for_the_group_commit() {
    let (node, mut c) = Node::session();
    c.declare_queue(1, "d", QueueOpts::durable()).unwrap();
    c.tx(1, 10);
    c.publish(1, "", "d", Message::persistent("m"));
    c.tx(1, 20);
    assert_eq!(ids(&mut c), [(90, 11)], "commit-ok before the fsync");
    node.sync();
    assert_eq!(ids(&mut c), [(90, 21)]);
}

#[test]
fn commit_on_a_channel_that_is_not_transactional_is_406() {
    let (_node, mut c) = Node::session();
    c.tx(1, 20);
    let e = c.expect_close(1);
    assert_eq!(e.code, 406);
    assert_eq!(e.text, "PRECONDITION_FAILED - channel is not transactional");
}

/// The ids of the publishes the node forwarded to `n2`.
fn forwarded_publishes(node: &Node) -> Vec<u64> {
    node.with_broker(warren_broker::Broker::take_link_out)
        .into_iter()
        .flat_map(|(_, msgs)| msgs)
        .filter_map(|m| match m {
            LinkMsg::Publish { id, .. } => Some(id),
            _ => None,
        })
        .collect()
}

/// A transaction's publishes to a queue served by another node: commit-ok
/// once that node confirms them all; if it refuses one (the queue's
/// mirrored master went), the commit fails with 406 as RabbitMQ's channel
/// does ("partial tx completion"), instead of a commit-ok for a message
/// that is gone.
#[test]
fn a_commit_whose_forwarded_publish_is_refused_fails_with_406() {
    for refused in [false, true] {
        let (node, mut c) = Node::session();
        c.queue(1, "far");
        node.with_broker(|b| b.set_queue_master("/", "far", Some("n2")));
        c.tx(1, 10);
        c.publish(1, "", "far", Message::new("a"));
        c.publish(1, "", "far", Message::new("b"));
        c.tx(1, 20);
        let sent = forwarded_publishes(&node);
        assert_eq!(sent.len(), 2, "both forwarded at commit");
        assert_eq!(ids(&mut c), [(90, 11)], "no commit-ok yet");
        let answer = if refused {
            LinkMsg::Nacked { ids: vec![sent[0]] }
        } else {
            LinkMsg::Confirmed { ids: vec![sent[0]] }
        };
        node.with_broker(|b| {
            b.link_input(
                "n2",
                vec![answer, LinkMsg::Confirmed { ids: vec![sent[1]] }],
                START_MS,
            );
        });
        c.pump();
        if refused {
            let closed = c.expect_close(1);
            assert_eq!(
                (
                    closed.connection,
                    closed.code,
                    closed.class_id,
                    closed.method_id
                ),
                (false, 406, 90, 20)
            );
            assert_eq!(closed.text, "PRECONDITION_FAILED - partial tx completion");
        } else {
            assert_eq!(ids(&mut c), [(90, 21)], "tx.commit-ok");
        }
    }
}

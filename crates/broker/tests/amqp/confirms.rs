//! Publisher confirms: a persistent message on a durable queue is acked
//! only once a group commit has made it durable; others at once; refused
//! ones nacked (`broker/publish.rs`, `broker/persistence.rs`).

use warren_amqp::amq_protocol::protocol::{AMQPClass, basic, queue};
use warren_amqp::amq_protocol::types::AMQPValue;
use warren_broker::LinkMsg;

use crate::support::{Client, Incoming, Message, Node, QueueOpts, START_MS};

/// A confirm's `(kind, delivery tag, multiple)`: kind "ack" or "nack".
fn confirm(i: &Incoming) -> Option<(&'static str, u64, bool)> {
    match &i.method {
        AMQPClass::Basic(basic::AMQPMethod::Ack(a)) => Some(("ack", a.delivery_tag, a.multiple)),
        AMQPClass::Basic(basic::AMQPMethod::Nack(n)) => Some(("nack", n.delivery_tag, n.multiple)),
        _ => None,
    }
}

/// The confirms received so far.
pub(crate) fn confirms(c: &mut Client) -> Vec<(&'static str, u64, bool)> {
    c.drain().iter().filter_map(confirm).collect()
}

/// A client whose channel 1 is in confirm mode.
pub(crate) fn confirming(node: &Node) -> Client {
    let mut c = node.connect();
    c.open_channel(1);
    c.confirm_select(1);
    c
}

/// A confirming client that published one persistent message into the
/// new durable queue `d`.
fn published_one_persistent(node: &Node) -> Client {
    let mut c = confirming(node);
    c.declare_queue(1, "d", QueueOpts::durable()).unwrap();
    c.publish(1, "", "d", Message::persistent("m"));
    c
}

/// A waker for the broker that counts its calls.
fn counting_waker() -> (
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
    warren_broker::Waker,
) {
    let woken = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let w = woken.clone();
    let waker = std::sync::Arc::new(move || {
        w.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    });
    (woken, waker)
}

#[test]
fn a_persistent_message_on_a_durable_queue_is_confirmed_after_the_group_commit() {
    let node = Node::new();
    let mut c = published_one_persistent(&node);
    assert_eq!(confirms(&mut c), [], "confirmed before its fsync");
    node.sync();
    let got = confirms(&mut c);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!((got[0].0, got[0].1), ("ack", 1));
    // Durable indeed: the message is there.
    assert_eq!(c.get_all(1, "d"), [b"m".to_vec()]);
}

/// A publish can come before the group commit's thread gave the broker
/// its waker (a link accepted while the node starts): the commit it asked
/// for is still made, the waker called as it is set. Before, the commit
/// stayed wanted and nothing woke the thread, so no persistent publish of
/// the node was confirmed until it restarted (chaos seed 50014: a
/// restarted node answered no forwarded publish for 15 s).
#[test]
fn a_commit_wanted_before_the_sync_waker_is_set_wakes_it() {
    let node = Node::new();
    let mut c = published_one_persistent(&node);
    let (woken, waker) = counting_waker();
    node.with_broker(|b| b.set_sync_waker(waker));
    assert_eq!(woken.load(std::sync::atomic::Ordering::SeqCst), 1);
    node.sync();
    let got = confirms(&mut c);
    assert_eq!(got.len(), 1, "{got:?}");
}

#[test]
fn transient_or_unroutable_publishes_are_confirmed_at_once() {
    let node = Node::new();
    let mut c = confirming(&node);
    c.queue(1, "t");
    c.declare_queue(1, "d", QueueOpts::durable()).unwrap();
    let publishes = [
        ("", "t", Message::persistent("persistent, transient queue")),
        ("", "d", Message::new("transient, durable queue")),
        ("amq.direct", "nowhere", Message::persistent("unroutable")),
    ];
    for (seq, (exchange, key, msg)) in (1..).zip(publishes) {
        c.publish(1, exchange, key, msg);
        let got: Vec<(&str, u64)> = confirms(&mut c).iter().map(|x| (x.0, x.1)).collect();
        assert_eq!(got, [("ack", seq)], "publish {seq}");
    }
}

#[test]
fn a_later_publish_is_not_acked_together_with_one_waiting_for_its_fsync() {
    let node = Node::new();
    let mut c = confirming(&node);
    c.declare_queue(1, "d", QueueOpts::durable()).unwrap();
    c.queue(1, "t");
    c.publish(1, "", "d", Message::persistent("waits"));
    c.publish(1, "", "t", Message::new("at once"));
    // Publish 2 may be acked on its own, never with 1 (multiple).
    for (kind, tag, multiple) in confirms(&mut c) {
        assert_eq!((kind, tag, multiple), ("ack", 2, false));
    }
    node.sync();
    let got = confirms(&mut c);
    assert!(
        got.iter()
            .any(|&(k, tag, multiple)| k == "ack" && (tag == 1 || (multiple && tag >= 1))),
        "publish 1 not acked after the group commit: {got:?}"
    );
}

#[test]
fn an_unroutable_mandatory_message_is_returned_before_it_is_acked() {
    let node = Node::new();
    let mut c = confirming(&node);
    c.publish(1, "amq.direct", "nowhere", Message::new("m").mandatory());
    let got = c.drain();
    let ids: Vec<(u16, u16)> = got.iter().map(Incoming::ids).collect();
    assert_eq!(
        ids,
        [(60, 50), (60, 80)],
        "basic.return then basic.ack: {got:?}"
    );
}

#[test]
fn a_full_reject_publish_queue_nacks() {
    let node = Node::new();
    let mut c = confirming(&node);
    let opts = QueueOpts::default()
        .arg("x-max-length", AMQPValue::LongInt(1))
        .arg("x-overflow", AMQPValue::LongString("reject-publish".into()));
    c.declare_queue(1, "q", opts).unwrap();
    c.publish(1, "", "q", Message::new("kept"));
    c.publish(1, "", "q", Message::new("refused"));
    let got: Vec<(&str, u64)> = confirms(&mut c).iter().map(|x| (x.0, x.1)).collect();
    assert_eq!(got, [("ack", 1), ("nack", 2)]);
    assert_eq!(c.get_all(1, "q"), [b"kept".to_vec()]);
}

/// The bodies of the publishes the node forwarded, with their link ids.
fn forwarded(node: &Node) -> Vec<(u64, Vec<u8>)> {
    node.with_broker(warren_broker::Broker::take_link_out)
        .into_iter()
        .flat_map(|(_, msgs)| msgs)
        .filter_map(|m| match m {
            LinkMsg::Publish { id, body, .. } => Some((id, body.to_vec())),
            _ => None,
        })
        .collect()
}

/// Publishes to a queue that has no master right now (its master is
/// handing it over, or its node went and no successor is named yet) wait
/// for the next master, in order, and are confirmed by it: RabbitMQ's
/// channels send each publish to the mirrors too, so a master's move nacks
/// none of them.
#[test]
fn publishes_to_a_queue_without_a_master_wait_for_the_next_one() {
    let node = Node::new();
    let mut c = confirming(&node);
    c.queue(1, "q");
    node.with_broker(|b| b.hold_for_replica("/", "q"));
    for body in ["a", "b", "c"] {
        c.publish(1, "", "q", Message::new(body));
    }
    assert_eq!(confirms(&mut c), [], "neither confirmed nor nacked");
    assert!(forwarded(&node).is_empty());
    node.tick(START_MS + 50);
    assert_eq!(confirms(&mut c), []);
    // A declare meanwhile waits for the next master's counts.
    let passive = AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
        queue: "q".into(),
        passive: true,
        ..Default::default()
    }));
    c.send(1, passive);
    c.pump();
    assert!(
        c.drain().is_empty(),
        "declare-ok before the queue has a master"
    );

    node.with_broker(|b| b.set_queue_master("/", "q", Some("n2")));
    let out: Vec<LinkMsg> = node
        .with_broker(warren_broker::Broker::take_link_out)
        .into_iter()
        .flat_map(|(_, msgs)| msgs)
        .collect();
    let sent: Vec<(u64, Vec<u8>)> = out
        .iter()
        .filter_map(|m| match m {
            LinkMsg::Publish { id, body, .. } => Some((*id, body.to_vec())),
            _ => None,
        })
        .collect();
    let bodies: Vec<&[u8]> = sent.iter().map(|(_, b)| b.as_slice()).collect();
    assert_eq!(bodies, [b"a", b"b", b"c"], "sent on in order");
    // The count is asked after them, so it counts them.
    let Some(LinkMsg::Count { req, .. }) = out.last() else {
        panic!("no count asked after the publishes: {out:?}");
    };
    let counted = LinkMsg::Counted {
        req: *req,
        messages: 3,
        consumers: 0,
    };
    node.with_broker(|b| b.link_input("n2", vec![counted], START_MS));
    c.pump();
    let answers = c.drain();
    assert!(
        matches!(
            &answers[..],
            [i] if matches!(&i.method, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) if ok.message_count == 3)
        ),
        "{answers:?}"
    );
    // A later publish follows them.
    c.publish(1, "", "q", Message::new("d"));
    let later = forwarded(&node);
    assert_eq!(later.len(), 1);
    let ids = sent.iter().chain(&later).map(|(id, _)| *id).collect();
    node.with_broker(|b| b.link_input("n2", vec![LinkMsg::Confirmed { ids }], START_MS));
    c.pump();
    let got: Vec<(&str, u64)> = confirms(&mut c).iter().map(|x| (x.0, x.1)).collect();
    let acked: Vec<u64> = got.iter().filter(|x| x.0 == "ack").map(|x| x.1).collect();
    assert!(got.iter().all(|x| x.0 == "ack"), "{got:?}");
    assert_eq!(acked.iter().max(), Some(&4), "{got:?}");
}

/// Held publishes are nacked if no master takes the queue within ten
/// seconds (the publisher resends), and confirmed if the queue is deleted
/// meanwhile (as the messages of a deleted queue).
#[test]
fn held_publishes_are_nacked_after_ten_seconds_and_confirmed_if_the_queue_goes() {
    let node = Node::new();
    let mut c = confirming(&node);
    c.queue(1, "q");
    c.queue(1, "gone");
    node.with_broker(|b| {
        b.hold_for_replica("/", "q");
        b.hold_for_replica("/", "gone");
    });
    c.publish(1, "", "q", Message::new("waits"));
    c.publish(1, "", "gone", Message::new("deleted"));
    assert_eq!(confirms(&mut c), []);
    let delete = AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
        queue: "gone".into(),
        if_unused: false,
        if_empty: false,
        nowait: false,
    }));
    c.send(1, delete);
    c.pump();
    let answers = c.drain();
    assert!(
        answers.iter().any(|i| i.ids() == (50, 41)),
        "queue.delete-ok: {answers:?}"
    );
    let got: Vec<(&str, u64)> = answers
        .iter()
        .filter_map(confirm)
        .map(|x| (x.0, x.1))
        .collect();
    assert_eq!(got, [("ack", 2)], "the deleted queue's publish");
    node.tick(START_MS + 9_999);
    assert_eq!(confirms(&mut c), []);
    node.tick(START_MS + 10_000);
    // (A `multiple` ack may cover the deleted queue's publish again.)
    let got: Vec<(&str, u64, bool)> = confirms(&mut c);
    assert_eq!(got[0], ("nack", 1, false), "{got:?}");
    assert!(got[1..].iter().all(|x| x.0 == "ack" && x.1 == 2), "{got:?}");
}

/// A forwarded publish: (to node, link id, identity, body).
type Sent = (String, u64, (u64, u64), Vec<u8>);

/// The publishes the node forwarded.
fn forwarded_to(node: &Node) -> Vec<Sent> {
    node.with_broker(warren_broker::Broker::take_link_out)
        .into_iter()
        .flat_map(|(to, msgs)| msgs.into_iter().map(move |m| (to.clone(), m)))
        .filter_map(|(to, m)| match m {
            LinkMsg::Publish {
                id,
                publisher,
                first,
                body,
                ..
            } => Some((to, id, (publisher, first.unwrap_or(id)), body.to_vec())),
            _ => None,
        })
        .collect()
}

/// A confirming client of queue `ha.q`, mirrored by policy (`ha-mode:
/// all`), whose master is on node n2; `a` and `b` published and forwarded.
fn publishing_to_a_mirrored_queue_on_n2() -> (Node, Client, Vec<Sent>) {
    publishing_to_a_mirrored_queue_on_n2_as(confirming)
}

/// The same with a client opened by `client`.
fn publishing_to_a_mirrored_queue_on_n2_as(
    client: fn(&Node) -> Client,
) -> (Node, Client, Vec<Sent>) {
    let node = Node::new();
    let mut c = client(&node);
    node.with_broker(|b| {
        b.apply_policies(&[warren_broker::meta::PolicyDef {
            vhost: "/".into(),
            name: "ha".into(),
            pattern: "^ha\\.".into(),
            apply_to: "queues".into(),
            priority: 0,
            definition: serde_json::json!({"ha-mode": "all"}),
            operator: false,
        }]);
    });
    c.queue(1, "ha.q");
    node.with_broker(|b| b.set_queue_master("/", "ha.q", Some("n2")));
    c.publish(1, "", "ha.q", Message::persistent("a"));
    c.publish(1, "", "ha.q", Message::persistent("b"));
    let first = forwarded_to(&node);
    assert_eq!(first.len(), 2);
    (node, c, first)
}

/// Names n3 the master of `ha.q`, whose master's node n2 went down after
/// `first` (a, b) were forwarded to it and before c was published: all
/// three go to n3 in order, a and b under their first identity (stream and
/// id). Returns them.
fn sent_again_to_n3(node: &Node, first: &[Sent]) -> Vec<Sent> {
    node.with_broker(|b| b.set_queue_master("/", "ha.q", Some("n3")));
    let again = forwarded_to(node);
    let bodies: Vec<&[u8]> = again.iter().map(|f| f.3.as_slice()).collect();
    assert_eq!(bodies, [b"a", b"b", b"c"], "in order: {again:?}");
    assert!(again.iter().all(|f| f.0 == "n3"));
    let ids = |v: &[Sent]| -> Vec<(u64, u64)> { v.iter().map(|f| f.2).collect() };
    assert_eq!(ids(&again[..2]), ids(first), "under their first identity");
    again
}

/// Publishes forwarded to a mirrored queue's master whose node goes down
/// before confirming them are not nacked (RabbitMQ's publishers see none
/// when a master dies: its mirrors hold every publish from the channel
/// too): they are sent again, under the identity they first went with, to
/// the next master, which confirms those its ring holds already and takes
/// the others; a publish meanwhile waits behind them. Before, all were
/// nacked (pika raises `NackError`).
#[test]
fn publishes_forwarded_to_a_master_that_goes_down_are_sent_again_to_the_next() {
    let (node, mut c, first) = publishing_to_a_mirrored_queue_on_n2();
    node.with_broker(|b| b.link_down("n2", START_MS + 10));
    c.pump();
    assert_eq!(confirms(&mut c), [], "nothing nacked");
    c.publish(1, "", "ha.q", Message::persistent("c"));
    assert_eq!(
        forwarded_to(&node),
        [],
        "nothing sent to a node that is down"
    );
    node.tick(START_MS + 1_000);
    assert_eq!(confirms(&mut c), []);
    let again = sent_again_to_n3(&node, &first);
    assert_ne!(
        again[2].2.0, first[0].2.0,
        "a new link session, a new stream"
    );
    let confirmed = LinkMsg::Confirmed {
        ids: again.iter().map(|f| f.1).collect(),
    };
    node.with_broker(|b| b.link_input("n3", vec![confirmed], START_MS + 1_100));
    c.pump();
    assert_eq!(confirms(&mut c), [("ack", 3, true)], "all three acked");
}

/// The same with no new master and the link back: sent again to the same
/// node, which holds each identity once. And with neither: nacked
/// `RESEND_WAIT_MS` (3 s) after they were published, so that a publisher
/// cut off from a master that is not replaced is answered within the
/// failure timeout.
#[test]
fn publishes_held_for_a_master_that_went_down_go_to_it_when_its_link_is_back_or_are_nacked() {
    let (node, mut c, first) = publishing_to_a_mirrored_queue_on_n2();
    node.with_broker(|b| b.link_down("n2", START_MS + 10));
    node.with_broker(|b| b.resubscribe("n2"));
    let again = forwarded_to(&node);
    let same = |v: &[Sent]| -> Vec<(String, (u64, u64), Vec<u8>)> {
        v.iter().map(|f| (f.0.clone(), f.2, f.3.clone())).collect()
    };
    assert_eq!(same(&again), same(&first), "the same, to n2 again");
    node.with_broker(|b| b.link_down("n2", START_MS + 20));
    node.tick(START_MS + 2_999);
    assert_eq!(confirms(&mut c), []);
    node.tick(START_MS + 3_000);
    let got: Vec<(&str, u64)> = confirms(&mut c).iter().map(|x| (x.0, x.1)).collect();
    assert_eq!(got, [("nack", 1), ("nack", 2)]);
    assert_eq!(forwarded_to(&node), []);
}

/// A mirrored queue's master moves from n2 to n3 while publishes forwarded
/// to n2 are not yet confirmed: n2 holds them and sends them on to n3
/// itself. A publish made meanwhile waits here until n2 settled them, so
/// that it reaches n3 after them, in its channel's order; it waits
/// `RESEND_WAIT_MS` (3 s) at most. Before, it went straight to n3 and came
/// first (chaos seed 53005, `--long-pauses --slow-links`: a publisher's
/// first messages after a failover delivered after later ones, not
/// flagged redelivered).
#[test]
fn a_publish_after_its_queues_master_moved_waits_for_those_forwarded_to_the_old_one() {
    let (node, mut c, first) = publishing_to_a_mirrored_queue_on_n2();
    node.with_broker(|b| b.set_queue_master("/", "ha.q", Some("n3")));
    c.publish(1, "", "ha.q", Message::persistent("c"));
    assert_eq!(forwarded_to(&node), [], "held behind a and b");
    let settle = |msg: LinkMsg, at: u64| node.with_broker(|b| b.link_input("n2", vec![msg], at));
    settle(
        LinkMsg::Confirmed {
            ids: vec![first[0].1],
        },
        START_MS + 100,
    );
    assert_eq!(forwarded_to(&node), [], "b still out");
    settle(
        LinkMsg::Nacked {
            ids: vec![first[1].1],
        },
        START_MS + 200,
    );
    let sent = forwarded_to(&node);
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(
        (sent[0].0.as_str(), sent[0].3.as_slice()),
        ("n3", &b"c"[..])
    );
    c.pump();
    let got: Vec<(&str, u64)> = confirms(&mut c).iter().map(|x| (x.0, x.1)).collect();
    assert_eq!(got, [("ack", 1), ("nack", 2)]);

    // n2 never answers: the publish goes on after 3 s.
    let (node, _c, _) = publishing_to_a_mirrored_queue_on_n2();
    node.with_broker(|b| b.set_queue_master("/", "ha.q", Some("n3")));
    let mut c = confirming(&node);
    c.publish(1, "", "ha.q", Message::persistent("c"));
    node.tick(START_MS + 2_999);
    assert_eq!(forwarded_to(&node), []);
    node.tick(START_MS + 3_000);
    let sent = forwarded_to(&node);
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(
        (sent[0].0.as_str(), sent[0].3.as_slice()),
        ("n3", &b"c"[..])
    );
}

/// A client that publishes without confirms, on channel 1.
fn not_confirming(node: &Node) -> Client {
    let mut c = node.connect();
    c.open_channel(1);
    c
}

/// Publishes made without confirm mode keep their channel's order across
/// a master's move too, as RabbitMQ's do (its channels give them to the
/// queue's mirrors as well): n2 confirms to this node every publish
/// forwarded to it, asked or not, so the publish made after the move waits
/// here until n2 settled those before it. Before, this node kept no record
/// of them, and the later one went straight to n3, ahead of them.
#[test]
fn an_unconfirmed_publish_after_its_queues_master_moved_waits_for_those_forwarded_to_the_old_one() {
    let (node, mut c, first) = publishing_to_a_mirrored_queue_on_n2_as(not_confirming);
    node.with_broker(|b| b.set_queue_master("/", "ha.q", Some("n3")));
    c.publish(1, "", "ha.q", Message::persistent("c"));
    assert_eq!(forwarded_to(&node), [], "held behind a and b");
    let ids = first.iter().map(|f| f.1).collect();
    node.with_broker(|b| b.link_input("n2", vec![LinkMsg::Confirmed { ids }], START_MS + 100));
    let sent = forwarded_to(&node);
    let to: Vec<(&str, &[u8])> = sent.iter().map(|f| (f.0.as_str(), &f.3[..])).collect();
    assert_eq!(to, [("n3", &b"c"[..])]);
    c.pump();
    assert_eq!(
        confirms(&mut c),
        [],
        "no confirm to a client that asked none"
    );
}

/// Unconfirmed publishes forwarded to a mirrored queue's master whose node
/// goes down before it confirmed them to this node are sent again to the
/// next master, ahead of the one made meanwhile, like confirmed ones: on
/// RabbitMQ the queue's mirrors hold them. Before, they were lost.
#[test]
fn unconfirmed_publishes_forwarded_to_a_master_that_goes_down_are_sent_again_to_the_next() {
    let (node, mut c, first) = publishing_to_a_mirrored_queue_on_n2_as(not_confirming);
    node.with_broker(|b| b.link_down("n2", START_MS + 10));
    c.publish(1, "", "ha.q", Message::persistent("c"));
    assert_eq!(forwarded_to(&node), []);
    sent_again_to_n3(&node, &first);
    c.pump();
    assert_eq!(confirms(&mut c), []);
}

/// n2, the old master, passing `first` on to this node under their
/// identity (stream, id).
fn passed_back(first: &[Sent]) -> Vec<LinkMsg> {
    first
        .iter()
        .map(|f| LinkMsg::Publish {
            vhost: "/".into(),
            queue: "ha.q".into(),
            id: f.2.1,
            publisher: f.2.0,
            first: None,
            meta: bytes::Bytes::new(),
            body: bytes::Bytes::from(f.3.clone()),
            persistent: true,
            expiration_ms: None,
            priority: 0,
        })
        .collect()
}

/// The same when the master moves to this node: n2 passes the publishes
/// forwarded to it on to this node, and they go in at once, ahead of the
/// one made meanwhile, which goes in once n2 settled them. Before, the
/// later one went straight into the queue, ahead of them.
#[test]
fn publishes_the_old_master_passes_back_go_in_ahead_of_those_made_after_the_move() {
    let (node, mut c, first) = publishing_to_a_mirrored_queue_on_n2();
    node.with_broker(|b| b.set_queue_master("/", "ha.q", None));
    c.publish(1, "", "ha.q", Message::persistent("c"));
    node.with_broker(|b| b.link_input("n2", passed_back(&first), START_MS + 100));
    n2_settles_and_a_b_c_are_in(&node, &mut c, &first);
}

/// The same when n2's passed-on publishes come before this node hears of
/// the move (it still takes n2 for the master, so they are held for it):
/// once the move is known they go in at once, ahead of what was held after
/// them, and the publish made meanwhile once n2 settled a and b. Before,
/// they waited behind the wait for n2, whose end waited for them: nothing
/// moved for the whole wait (`RESEND_WAIT_MS`, 3 s), as a fault schedule
/// found (docs/faults.md, "The old master's passed-on publishes").
#[test]
fn publishes_the_old_master_passes_back_before_the_move_is_known_go_in_at_once() {
    let (node, mut c, first) = publishing_to_a_mirrored_queue_on_n2();
    node.with_broker(|b| b.link_input("n2", passed_back(&first), START_MS + 50));
    node.with_broker(|b| b.set_queue_master("/", "ha.q", None));
    c.publish(1, "", "ha.q", Message::persistent("c"));
    let to_n2: Vec<LinkMsg> = node
        .with_broker(warren_broker::Broker::take_link_out)
        .into_iter()
        .filter(|(to, _)| to == "n2")
        .flat_map(|(_, msgs)| msgs)
        .collect();
    let passed_ids: Vec<u64> = first.iter().map(|f| f.2.1).collect();
    assert!(
        to_n2.contains(&LinkMsg::Confirmed { ids: passed_ids }),
        "a and b taken in at once and confirmed to n2: {to_n2:?}"
    );
    n2_settles_and_a_b_c_are_in(&node, &mut c, &first);
}

/// n2 settles `first` (a, b), forwarded to it: all three publishes are
/// confirmed and in the queue, in order.
fn n2_settles_and_a_b_c_are_in(node: &Node, c: &mut Client, first: &[Sent]) {
    let ids = first.iter().map(|f| f.1).collect();
    node.with_broker(|b| b.link_input("n2", vec![LinkMsg::Confirmed { ids }], START_MS + 200));
    c.pump();
    assert_eq!(confirms(c), [("ack", 3, true)]);
    assert_eq!(
        c.get_all(1, "ha.q"),
        [b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]
    );
}

/// A publish forwarded by node n2 to durable queue `d`, served alone here:
/// link id `id`, first sent as `first` (`None`: a first send).
fn forwarded_publish(id: u64, first: Option<u64>) -> LinkMsg {
    LinkMsg::Publish {
        vhost: "/".into(),
        queue: "d".into(),
        id,
        publisher: 1,
        first,
        meta: bytes::Bytes::new(),
        body: bytes::Bytes::from(format!("m{}", first.unwrap_or(id))),
        persistent: true,
        expiration_ms: None,
        priority: 0,
    }
}

/// The ids node n2 hears confirmed and nacked for the `publishes` it
/// forwards here, after a group commit.
fn answers(node: &Node, publishes: Vec<LinkMsg>) -> (Vec<u64>, Vec<u64>) {
    node.with_broker(|b| b.link_input("n2", publishes, START_MS));
    node.sync();
    let (mut acked, mut nacked) = (Vec::new(), Vec::new());
    for m in node
        .with_broker(warren_broker::Broker::take_link_out)
        .into_iter()
        .flat_map(|(_, m)| m)
    {
        match m {
            LinkMsg::Confirmed { ids } => acked.extend(ids),
            LinkMsg::Nacked { ids } => nacked.extend(ids),
            _ => {}
        }
    }
    (acked, nacked)
}

/// A node's first link input can come before its shell set the link waker
/// (the listener accepts as soon as it is up): the confirms of that link's
/// publishes, answered after the group commit, still wake the shell, or
/// they would wait, and their publishers with them, until something else
/// did (found in the start-up order while tracing chaos seed 50014, whose
/// cause was the group commit's waker:
/// `a_commit_wanted_before_the_sync_waker_is_set_wakes_it`).
#[test]
fn a_link_that_came_before_the_link_waker_wakes_it() {
    let node = Node::durable();
    let mut c = confirming(&node);
    c.declare_queue(1, "d", QueueOpts::durable()).unwrap();
    node.with_broker(|b| b.link_input("n2", vec![forwarded_publish(1, None)], START_MS));
    let (woken, waker) = counting_waker();
    node.with_broker(|b| b.set_link_waker(waker));
    let before = woken.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(before, 1, "its output waiting (`Taken`) woke it at once");
    node.sync();
    assert!(
        woken.load(std::sync::atomic::Ordering::SeqCst) > before,
        "the confirm woke the link shell"
    );
    assert_eq!(answers(&node, vec![]), (vec![1], vec![]));
}

/// A publish sent again (its origin lost the link before the confirm) to a
/// queue this node serves alone is taken once: the store notes what it
/// took, also for a mirrored master that may start from it later; one
/// sent again that it holds already is refused (the publisher hears it may
/// be lost), not taken twice. Opened again from disk, the store cannot
/// tell what it holds: a publish sent again is refused, a first one taken,
/// and from then on that publisher's are known, as a mirrored master
/// recovered from disk knows them (`HeldPublishes`).
#[test]
fn a_publish_sent_again_to_a_queue_served_alone_is_taken_once() {
    let node = Node::durable();
    let mut c = confirming(&node);
    c.declare_queue(1, "d", QueueOpts::durable()).unwrap();
    let first = vec![forwarded_publish(1, None), forwarded_publish(2, None)];
    assert_eq!(answers(&node, first), (vec![1, 2], vec![]));
    let again = vec![forwarded_publish(3, Some(2)), forwarded_publish(4, Some(5))];
    assert_eq!(answers(&node, again), (vec![4], vec![3]));
    node.restart();
    let after = vec![forwarded_publish(6, Some(7)), forwarded_publish(8, None)];
    assert_eq!(answers(&node, after), (vec![8], vec![6]));
    let heard = vec![
        forwarded_publish(9, Some(8)),
        forwarded_publish(10, Some(10)),
    ];
    assert_eq!(answers(&node, heard), (vec![10], vec![9]));
    let mut c = confirming(&node);
    let got: Vec<Vec<u8>> = c.get_all(1, "d");
    assert_eq!(
        got,
        [
            b"m1".to_vec(),
            b"m2".to_vec(),
            b"m5".to_vec(),
            b"m8".to_vec(),
            b"m10".to_vec()
        ]
    );
}

//! Handing messages to consumers and settling them: prefetch, round-robin,
//! reject and requeue, basic.get, recover, cancel (`broker/dispatch.rs`).

use warren_amqp::amq_protocol::protocol::{AMQPClass, basic, channel, queue};
use warren_amqp::amq_protocol::types::AMQPValue;
use warren_broker::LinkMsg;

use crate::support::{Client, Incoming, Message, Node, QueueOpts, START_MS, consume_method, table};

/// A basic.deliver's `(delivery tag, redelivered, body)`.
fn delivered(i: &Incoming) -> (u64, bool, String) {
    let AMQPClass::Basic(basic::AMQPMethod::Deliver(d)) = &i.method else {
        panic!("expected basic.deliver, got {i:?}");
    };
    (
        d.delivery_tag,
        d.redelivered,
        String::from_utf8(i.body.clone()).unwrap(),
    )
}

/// Every basic.deliver received so far.
fn deliveries(c: &mut Client) -> Vec<(u64, bool, String)> {
    c.drain().iter().map(delivered).collect()
}

/// A client of a fresh broker with channel 1 open and queue `q` holding
/// `n` messages m0….
fn queue_with(n: usize) -> Client {
    let (_node, mut c) = Node::session();
    c.queue(1, "q");
    for i in 0..n {
        c.publish(1, "", "q", Message::new(&format!("m{i}")));
    }
    c
}

#[test]
fn prefetch_limits_the_deliveries_in_flight() {
    let mut c = queue_with(5);
    c.qos(1, 2, false);
    c.consume(1, "q", "ctag", false);
    assert_eq!(
        deliveries(&mut c),
        [(1, false, "m0".into()), (2, false, "m1".into())]
    );
    c.ack(1, 1, false);
    assert_eq!(deliveries(&mut c), [(3, false, "m2".into())]);
    // A multiple ack frees two places at once.
    c.ack(1, 3, true);
    assert_eq!(
        deliveries(&mut c),
        [(4, false, "m3".into()), (5, false, "m4".into())]
    );
    assert!(deliveries(&mut c).is_empty());
}

#[test]
fn a_no_ack_consumer_is_not_held_by_prefetch() {
    let mut c = queue_with(5);
    c.qos(1, 1, false);
    c.consume(1, "q", "ctag", true);
    assert_eq!(deliveries(&mut c).len(), 5);
    assert_eq!(c.get_body(1, "q"), None);
}

#[test]
fn consumers_of_one_queue_take_turns() {
    let (_node, mut c) = Node::session();
    c.queue(1, "q");
    c.open_channel(2);
    c.consume(1, "q", "a", true);
    c.consume(2, "q", "b", true);
    for i in 0..4 {
        c.publish(1, "", "q", Message::new(&format!("m{i}")));
    }
    let got: Vec<(u16, String)> = c
        .drain()
        .iter()
        .map(|i| (i.channel, delivered(i).2))
        .collect();
    assert_eq!(
        got,
        [
            (1, "m0".into()),
            (2, "m1".into()),
            (1, "m2".into()),
            (2, "m3".into())
        ]
    );
}

/// basic.consume of `q` on channel `ch` with `x-priority` `priority`
/// (manual acks).
fn consume_at(c: &mut Client, ch: u16, tag: &str, priority: Option<i32>) {
    let arguments = priority
        .map(|p| table(&[("x-priority", AMQPValue::LongInt(p))]))
        .unwrap_or_default();
    let m = AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
        queue: "q".into(),
        consumer_tag: tag.into(),
        no_local: false,
        no_ack: false,
        exclusive: false,
        nowait: false,
        arguments,
    }));
    c.call_ok(ch, m, (60, 21), "basic.consume-ok");
}

/// Which channel each delivery so far went to, with its body.
fn delivered_to(c: &mut Client) -> Vec<(u16, String)> {
    c.drain()
        .iter()
        .map(|i| (i.channel, delivered(i).2))
        .collect()
}

#[test]
fn a_higher_priority_consumer_gets_messages_while_it_has_room() {
    let (_node, mut c) = Node::session();
    c.queue(1, "q");
    for ch in [2, 3] {
        c.open_channel(ch);
        c.qos(ch, 1, false);
    }
    c.qos(1, 1, false);
    consume_at(&mut c, 1, "none", None);
    consume_at(&mut c, 2, "high", Some(5));
    consume_at(&mut c, 3, "minus", Some(-1));
    for i in 0..4 {
        c.publish(1, "", "q", Message::new(&format!("m{i}")));
    }
    assert_eq!(
        delivered_to(&mut c),
        [(2, "m0".into()), (1, "m1".into()), (3, "m2".into())]
    );
    // An ack makes room at the top: m3 goes there, not to the others.
    c.ack(2, 1, false);
    assert_eq!(delivered_to(&mut c), [(2, "m3".into())]);
}

#[test]
fn a_single_active_consumer_queue_hands_over_when_its_consumer_goes() {
    let (_node, mut c) = Node::session();
    let opts = QueueOpts::default().arg("x-single-active-consumer", AMQPValue::Boolean(true));
    c.declare_queue(1, "q", opts).unwrap();
    for ch in [2, 3] {
        c.open_channel(ch);
    }
    consume_at(&mut c, 1, "first", None);
    // Registered later, so waiting, whatever its priority.
    consume_at(&mut c, 2, "high", Some(9));
    consume_at(&mut c, 3, "third", None);
    for i in 0..3 {
        c.publish(1, "", "q", Message::new(&format!("m{i}")));
    }
    assert_eq!(
        delivered_to(&mut c),
        [(1, "m0".into()), (1, "m1".into()), (1, "m2".into())]
    );
    // Cancelled: the highest priority of those waiting takes over at once
    // (RabbitMQ 3.10 leaves none active; its documentation says this).
    let cancel = AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
        consumer_tag: "first".into(),
        nowait: false,
    }));
    c.call_ok(1, cancel, (60, 31), "basic.cancel-ok");
    c.publish(1, "", "q", Message::new("m3"));
    assert_eq!(delivered_to(&mut c), [(2, "m3".into())]);
    // Its channel closes: what it held comes back, to the new active one.
    c.close_channel(1);
    assert_eq!(
        delivered_to(&mut c),
        [(2, "m0".into()), (2, "m1".into()), (2, "m2".into())]
    );
    // An exclusive consumer is refused on such a queue.
    let mut exclusive = consume_method("q", "x", false);
    if let AMQPClass::Basic(basic::AMQPMethod::Consume(m)) = &mut exclusive {
        m.exclusive = true;
    }
    let e = c.call(3, exclusive).unwrap_err();
    assert_eq!(e.code, 403);
}

#[test]
fn a_delivery_unacked_past_the_consumer_timeout_closes_its_channel() {
    let (node, mut c) = Node::session();
    c.queue(1, "q");
    c.publish(1, "", "q", Message::new("slow"));
    c.open_channel(2);
    consume_at(&mut c, 2, "slow", None);
    assert_eq!(delivered_to(&mut c), [(2, "slow".into())]);
    // RabbitMQ 3.10's default: 30 minutes; not yet.
    let timeout = 30 * 60 * 1000;
    node.tick(START_MS + timeout);
    c.pump();
    assert!(c.drain().is_empty());
    node.tick(START_MS + timeout + 1_001);
    let e = c.expect_close(2);
    assert_eq!(
        (e.code, e.text.as_str()),
        (
            406,
            "PRECONDITION_FAILED - delivery acknowledgement on channel 2 timed out. Timeout value used: 1800000 ms. This timeout value can be configured, see consumers doc guide to learn more"
        )
    );
    // Back in its queue, for the next consumer.
    assert_eq!(c.counts(1, "q"), (1, 0));
}

#[test]
fn reject_with_requeue_redelivers_flagged_redelivered() {
    let mut c = queue_with(1);
    c.consume(1, "q", "ctag", false);
    assert_eq!(deliveries(&mut c), [(1, false, "m0".into())]);
    c.reject(1, 1, true);
    assert_eq!(deliveries(&mut c), [(2, true, "m0".into())]);
    // Without requeue (and no dead-letter exchange) it is gone.
    c.reject(1, 2, false);
    assert!(deliveries(&mut c).is_empty());
    assert_eq!(c.counts(1, "q"), (0, 1));
}

#[test]
fn basic_get_counts_what_remains_and_says_empty() {
    let mut c = queue_with(0);
    let empty = c.get(1, "q", false).unwrap();
    assert_eq!(empty.ids(), (60, 72), "basic.get-empty: {empty:?}");
    c.publish(1, "", "q", Message::new("a"));
    c.publish(1, "", "q", Message::new("b"));
    let first = c.get(1, "q", false).unwrap();
    let AMQPClass::Basic(basic::AMQPMethod::GetOk(ok)) = &first.method else {
        panic!("expected basic.get-ok, got {first:?}");
    };
    assert_eq!(
        (ok.delivery_tag, ok.redelivered, ok.message_count),
        (1, false, 1)
    );
    assert_eq!(ok.routing_key.as_str(), "q");
    assert_eq!(first.body, b"a");
    // Unacked, it comes back (redelivered) when rejected with requeue.
    c.reject(1, 1, true);
    let again = c.get(1, "q", true).unwrap();
    let AMQPClass::Basic(basic::AMQPMethod::GetOk(ok)) = &again.method else {
        panic!("expected basic.get-ok, got {again:?}");
    };
    assert_eq!((ok.redelivered, ok.message_count), (true, 1));
    assert_eq!(again.body, b"a");
    assert_eq!(c.get_all(1, "q"), [b"b".to_vec()]);
}

#[test]
fn closing_a_channel_requeues_its_unacked_deliveries() {
    let mut c = queue_with(2);
    c.open_channel(2);
    c.consume(2, "q", "ctag", false);
    assert_eq!(deliveries(&mut c).len(), 2);
    c.close_channel(2);
    let first = c.get(1, "q", true).unwrap();
    let AMQPClass::Basic(basic::AMQPMethod::GetOk(ok)) = &first.method else {
        panic!("expected basic.get-ok, got {first:?}");
    };
    assert!(ok.redelivered);
    assert_eq!(first.body, b"m0");
    assert_eq!(c.get_all(1, "q"), [b"m1".to_vec()]);
}

#[test]
fn recover_redelivers_what_is_unacked() {
    let mut c = queue_with(2);
    c.consume(1, "q", "ctag", false);
    assert_eq!(deliveries(&mut c).len(), 2);
    let ok = c
        .call(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Recover(basic::Recover { requeue: true })),
        )
        .unwrap();
    assert_eq!(ok.ids(), (60, 111), "basic.recover-ok: {ok:?}");
    assert_eq!(
        deliveries(&mut c),
        [(3, true, "m0".into()), (4, true, "m1".into())]
    );
}

#[test]
fn acking_an_unknown_delivery_tag_is_406() {
    let mut c = queue_with(0);
    c.ack(1, 99, false);
    let e = c.expect_close(1);
    assert_eq!(e.code, 406);
    assert_eq!(e.text, "PRECONDITION_FAILED - unknown delivery tag 99");
    assert_eq!((e.class_id, e.method_id), (60, 80));
}

#[test]
fn a_cancelled_consumer_gets_no_more() {
    let mut c = queue_with(0);
    c.consume(1, "q", "ctag", true);
    let cancel = AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
        consumer_tag: "ctag".into(),
        nowait: false,
    }));
    c.call_ok(1, cancel, (60, 31), "basic.cancel-ok");
    c.publish(1, "", "q", Message::new("m"));
    assert!(c.drain().is_empty());
    assert_eq!(c.counts(1, "q"), (1, 0));
}

#[test]
fn reusing_a_consumer_tag_on_a_channel_is_530() {
    let mut c = queue_with(0);
    c.consume(1, "q", "ctag", true);
    let e = c.call(1, consume_method("q", "ctag", true)).unwrap_err();
    assert_eq!(e.code, 530);
    assert_eq!(e.text, "NOT_ALLOWED - attempt to reuse consumer tag 'ctag'");
}

/// The request id of the first message the node sends down its links that
/// `pick` recognises.
fn forwarded(node: &Node, pick: impl Fn(&LinkMsg) -> Option<u64>) -> u64 {
    let out = node.with_broker(warren_broker::Broker::take_link_out);
    out.iter()
        .flat_map(|(_, msgs)| msgs)
        .find_map(pick)
        .expect("a request forwarded to n2")
}

/// A client of a node with queue `far`, served by node `n2`, and queue
/// `near`, served here and holding one message.
fn far_and_near() -> (Node, Client) {
    let (node, mut c) = Node::session();
    c.queue(1, "far");
    c.queue(1, "near");
    c.publish(1, "", "near", Message::new("here"));
    node.with_broker(|b| b.set_queue_master("/", "far", Some("n2")));
    (node, c)
}

/// Node `n2`'s answer comes down its link; returns the `(class, method)`
/// of what `c` receives then, in order.
fn answer_from_n2(node: &Node, c: &mut Client, msg: LinkMsg) -> Vec<(u16, u16)> {
    replies_from_n2(node, c, msg)
        .iter()
        .map(Incoming::ids)
        .collect()
}

/// [`answer_from_n2`], whole: what `c` receives then.
fn replies_from_n2(node: &Node, c: &mut Client, msg: LinkMsg) -> Vec<Incoming> {
    replies_from(node, c, "n2", msg)
}

/// What `c` receives once node `from`'s `msg` comes down its link.
fn replies_from(node: &Node, c: &mut Client, from: &str, msg: LinkMsg) -> Vec<Incoming> {
    node.with_broker(|b| b.link_input(from, vec![msg], START_MS));
    c.pump();
    c.drain()
}

/// The request id of the `LinkMsg::Count` forwarded to `n2`.
fn count_req(node: &Node) -> u64 {
    forwarded(node, |m| match m {
        LinkMsg::Count { req, .. } => Some(*req),
        _ => None,
    })
}

/// The master's answer to request `req`: `messages` ready, no consumers.
fn counted(req: u64, messages: u64) -> LinkMsg {
    LinkMsg::Counted {
        req,
        messages,
        consumers: 0,
    }
}

/// The one method `got` holds.
fn one_method(got: &[Incoming]) -> &AMQPClass {
    assert_eq!(got.len(), 1, "{got:?}");
    &got[0].method
}

/// A `basic.get` forwarded to the queue's master holds the connection's
/// later commands back until it is answered, so the replies keep the order
/// of the gets (a client matches each get-ok or get-empty with its get, in
/// order), as RabbitMQ's channel does.
#[test]
fn replies_to_gets_keep_their_order_when_one_is_forwarded() {
    let (node, mut c) = far_and_near();
    let get = |queue: &str| {
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: queue.into(),
            no_ack: true,
        }))
    };
    c.send(1, get("far"));
    c.send(1, get("near"));
    assert!(
        c.drain().is_empty(),
        "a get answered before the forwarded one"
    );
    assert!(c.input_paused(), "input read while a get waits");
    let req = forwarded(&node, |m| match m {
        LinkMsg::Get { req, .. } => Some(*req),
        _ => None,
    });
    let replies = answer_from_n2(&node, &mut c, LinkMsg::GetReply { req, msg: None });
    assert_eq!(
        replies,
        [(60, 72), (60, 71)],
        "get-empty (far), then get-ok (near)"
    );
    assert!(!c.input_paused());
}

/// A `queue.declare` of a queue served on another node waits for the
/// master's counts; the connection's next commands wait with it, so the
/// declare-ok comes first.
#[test]
fn a_declare_waiting_for_the_masters_counts_keeps_its_place() {
    let (node, mut c) = far_and_near();
    c.send(
        1,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "far".into(),
            passive: true,
            ..Default::default()
        })),
    );
    c.send(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: "near".into(),
            no_ack: true,
        })),
    );
    assert!(c.drain().is_empty(), "the get answered before the declare");
    let replies = answer_from_n2(&node, &mut c, counted(count_req(&node), 7));
    assert_eq!(
        replies,
        [(50, 11), (60, 71)],
        "declare-ok (far), then get-ok (near)"
    );
}

/// A `basic.consume` of a queue served on another node is answered once the
/// master has the consumer (as RabbitMQ's channel waits for the queue), so a
/// client told `consume-ok` holds an auto-delete or exclusive queue at once;
/// the connection's next commands wait with it.
#[test]
fn a_consume_of_a_forwarded_queue_is_answered_once_the_master_has_it() {
    let (node, mut c) = far_and_near();
    c.send(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: "far".into(),
            consumer_tag: "t".into(),
            ..Default::default()
        })),
    );
    c.send(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: "near".into(),
            no_ack: true,
        })),
    );
    assert!(
        c.drain().is_empty(),
        "consume-ok before the master has the consumer"
    );
    assert!(c.input_paused(), "input read while the consume waits");
    let cid = forwarded(&node, |m| match m {
        LinkMsg::Consume { cid, .. } => Some(*cid),
        _ => None,
    });
    let replies = answer_from_n2(&node, &mut c, LinkMsg::ConsumeOk { cid });
    assert_eq!(
        replies,
        [(60, 21), (60, 71)],
        "consume-ok (far), then get-ok (near)"
    );
}

/// A consume forwarded to a master that refuses it (the queue is in
/// exclusive use on another node) closes the client's channel with 403,
/// as on the master's node; the connection goes on.
#[test]
fn a_consume_the_master_refuses_closes_the_channel_with_403() {
    let (node, mut c) = far_and_near();
    c.send(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: "far".into(),
            consumer_tag: "t".into(),
            exclusive: true,
            ..Default::default()
        })),
    );
    let cid = forwarded(&node, |m| match m {
        LinkMsg::Consume {
            cid,
            exclusive: true,
            ..
        } => Some(*cid),
        _ => None,
    });
    let text = "queue 'far' in vhost '/' in exclusive use".to_owned();
    let replies = answer_from_n2(&node, &mut c, LinkMsg::ConsumeRefused { cid, text });
    assert_eq!(replies, [(20, 40)], "channel.close, no consume-ok");
    assert!(!c.input_paused(), "the connection still waits");
}

/// A master refuses a forwarded consumer while another node's (or its
/// own) exclusive consumer holds the queue, and a forwarded exclusive one
/// while the queue has consumers.
#[test]
fn a_master_refuses_forwarded_consumers_against_exclusive_use() {
    let (node, mut c) = Node::session();
    c.queue(1, "q");
    c.send(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: "q".into(),
            consumer_tag: "local".into(),
            ..Default::default()
        })),
    );
    let consume = |cid: u64, exclusive: bool| LinkMsg::Consume {
        vhost: "/".into(),
        queue: "q".into(),
        cid,
        prefetch: 0,
        no_ack: true,
        priority: 0,
        exclusive,
    };
    let out = node.with_broker(|b| {
        b.link_input("n2", vec![consume(1, true), consume(2, false)], START_MS);
        b.take_link_out()
    });
    let msgs: Vec<&LinkMsg> = out.iter().flat_map(|(_, m)| m).collect();
    assert!(
        matches!(
            msgs[..],
            [
                LinkMsg::ConsumeRefused { cid: 1, .. },
                LinkMsg::ConsumeOk { cid: 2 },
                ..
            ]
        ),
        "{msgs:?}"
    );
}

/// A `queue.purge` of a queue served on another node is made by its
/// master, and answered with the count the master removed.
#[test]
fn a_purge_of_a_forwarded_queue_is_made_by_its_master() {
    let (node, mut c) = far_and_near();
    c.send(
        1,
        AMQPClass::Queue(queue::AMQPMethod::Purge(queue::Purge {
            queue: "far".into(),
            nowait: false,
        })),
    );
    assert!(c.drain().is_empty(), "purge-ok before the master purged");
    let req = forwarded(&node, |m| match m {
        LinkMsg::Purge { req, .. } => Some(*req),
        _ => None,
    });
    let got = replies_from_n2(&node, &mut c, counted(req, 3));
    assert!(
        matches!(
            one_method(&got),
            AMQPClass::Queue(queue::AMQPMethod::PurgeOk(queue::PurgeOk {
                message_count: 3
            }))
        ),
        "{got:?}"
    );
}

/// A purge waiting for its master when the queue fails over is not made
/// again by the next master (the first may have purged, and a second would
/// take what came since): the client's channel is closed with 404, as
/// RabbitMQ answers for a queue whose node went down.
#[test]
fn a_purge_whose_master_fails_over_is_not_made_twice() {
    let (node, mut c) = far_and_near();
    c.send(
        1,
        AMQPClass::Queue(queue::AMQPMethod::Purge(queue::Purge {
            queue: "far".into(),
            nowait: false,
        })),
    );
    forwarded(&node, |m| match m {
        LinkMsg::Purge { req, .. } => Some(*req),
        _ => None,
    });
    node.with_broker(|b| b.set_queue_master("/", "far", Some("n3")));
    let out = node.with_broker(warren_broker::Broker::take_link_out);
    assert!(
        !out.iter()
            .flat_map(|(_, m)| m)
            .any(|m| matches!(m, LinkMsg::Purge { .. })),
        "asked again: {out:?}"
    );
    c.pump();
    let got: Vec<(u16, u16)> = c.drain().iter().map(Incoming::ids).collect();
    assert_eq!(got, [(20, 40)], "channel.close");
}

/// A `queue.delete` with if-empty or if-unused of a queue served on
/// another node checks the master's counts (a node that only forwards
/// holds none of the messages, nor the other nodes' consumers): refused
/// with 406 while the master has messages, made once it has none.
#[test]
fn a_conditional_delete_of_a_forwarded_queue_checks_the_masters_counts() {
    let (node, mut c) = far_and_near();
    let delete = || {
        AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
            queue: "far".into(),
            if_empty: true,
            ..Default::default()
        }))
    };
    c.send(1, delete());
    assert!(c.drain().is_empty(), "answered before the master's counts");
    let req = count_req(&node);
    let replies = answer_from_n2(&node, &mut c, counted(req, 2));
    assert_eq!(replies, [(20, 40)], "refused: channel.close");
    c.send(
        1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    );
    c.send(
        2,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    );
    c.drain();
    c.send(2, delete());
    let req = count_req(&node);
    let replies = answer_from_n2(&node, &mut c, counted(req, 0));
    assert_eq!(replies, [(50, 41)], "delete-ok");
    assert!(
        node.with_broker(|b| b.queues(Some("/")).iter().all(|q| q.name != "far")),
        "the queue is gone"
    );
}

/// A `queue.delete` of a queue served on another node answers with the
/// master's count of the messages it deletes (a mirror's copy here may
/// lag behind, and a node that only forwards has none).
#[test]
fn a_delete_of_a_forwarded_queue_counts_the_masters_messages() {
    let (node, mut c) = far_and_near();
    c.send(
        1,
        AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
            queue: "far".into(),
            ..Default::default()
        })),
    );
    let req = count_req(&node);
    let got = replies_from_n2(&node, &mut c, counted(req, 4));
    assert!(
        matches!(
            one_method(&got),
            AMQPClass::Queue(queue::AMQPMethod::DeleteOk(queue::DeleteOk {
                message_count: 4
            }))
        ),
        "{got:?}"
    );
}

/// A master that has a forwarded consumer says so on the link before it
/// delivers to it.
#[test]
fn a_master_confirms_a_forwarded_consumer_before_its_first_delivery() {
    let (node, mut c) = Node::session();
    c.queue(1, "q");
    c.publish(1, "", "q", Message::new("m"));
    let out = node.with_broker(|b| {
        b.link_input(
            "n2",
            vec![LinkMsg::Consume {
                vhost: "/".into(),
                queue: "q".into(),
                cid: 9,
                prefetch: 0,
                no_ack: true,
                priority: 0,
                exclusive: false,
            }],
            START_MS,
        );
        b.take_link_out()
    });
    let msgs: Vec<&LinkMsg> = out
        .iter()
        .filter(|(n, _)| n == "n2")
        .flat_map(|(_, m)| m)
        .collect();
    let ok = msgs
        .iter()
        .position(|m| matches!(m, LinkMsg::ConsumeOk { cid: 9 }))
        .expect("consume-ok sent down the link");
    let delivered = msgs
        .iter()
        .position(|m| matches!(m, LinkMsg::Deliver { cid: 9, .. }))
        .expect("the message delivered down the link");
    assert!(ok < delivered, "{msgs:?}");
}

/// A publish forwarded for a queue this master does not have (deleted, or
/// not known here yet) is nacked, never confirmed: nobody holds it.
#[test]
fn a_forwarded_publish_for_a_queue_the_master_lacks_is_nacked() {
    let (node, _c) = Node::session();
    let out = node.with_broker(|b| {
        b.link_input(
            "n2",
            vec![LinkMsg::Publish {
                vhost: "/".into(),
                queue: "nowhere".into(),
                id: 7,
                publisher: 1,
                first: None,
                meta: bytes::Bytes::new(),
                body: bytes::Bytes::from_static(b"m"),
                persistent: true,
                expiration_ms: None,
                priority: 0,
            }],
            START_MS,
        );
        b.take_link_out()
    });
    let msgs: Vec<&LinkMsg> = out.iter().flat_map(|(_, m)| m).collect();
    assert!(
        msgs.iter()
            .any(|m| matches!(m, LinkMsg::Nacked { ids } if ids == &[7])),
        "{msgs:?}"
    );
    assert!(
        !msgs.iter().any(|m| matches!(m, LinkMsg::Confirmed { .. })),
        "{msgs:?}"
    );
}

/// The messages node `node` sends to `to` down its link, but for flow
/// control's [`LinkMsg::Taken`].
fn sent_to(node: &Node, to: &str) -> Vec<LinkMsg> {
    node.with_broker(warren_broker::Broker::take_link_out)
        .into_iter()
        .filter(|(n, _)| n == to)
        .flat_map(|(_, m)| m)
        .filter(|m| !matches!(m, LinkMsg::Taken { .. }))
        .collect()
}

/// A `basic.get` forwarded here by node n2 for a queue whose master moved on
/// to n3 (n2 had not seen the move yet) goes on to n3, and n3's answer,
/// empty or a message, comes back to n2 as the answer to n2's request. It
/// was answered to nobody, and n2's client waited for it for ever.
#[test]
fn a_get_forwarded_on_to_a_new_master_is_answered_to_the_node_that_asked() {
    let (node, mut c) = Node::session();
    c.queue(1, "q");
    c.publish(1, "", "q", Message::new("near"));
    node.with_broker(|b| b.set_queue_master("/", "q", Some("n3")));
    let _ = node.with_broker(warren_broker::Broker::take_link_out);
    for (n2_req, answer) in [(5, None), (6, Some("m"))] {
        let get = LinkMsg::Get {
            vhost: "/".into(),
            queue: "q".into(),
            req: n2_req,
            no_ack: false,
        };
        node.with_broker(|b| b.link_input("n2", vec![get], START_MS));
        let req = sent_to(&node, "n3")
            .iter()
            .find_map(|m| match m {
                LinkMsg::Get { req, .. } => Some(*req),
                _ => None,
            })
            .expect("the get forwarded on to n3");
        let msg = answer.map(|body: &str| {
            (
                41,
                false,
                bytes::Bytes::new(),
                bytes::Bytes::from(body.to_owned()),
                0,
            )
        });
        node.with_broker(|b| b.link_input("n3", vec![LinkMsg::GetReply { req, msg }], START_MS));
        let replies = sent_to(&node, "n2");
        let reply = replies.iter().find_map(|m| match m {
            LinkMsg::GetReply { req, msg } => Some((*req, msg.as_ref().map(|m| m.3.clone()))),
            _ => None,
        });
        assert_eq!(
            reply,
            Some((n2_req, answer.map(|b| bytes::Bytes::from(b.to_owned())))),
            "{replies:?}"
        );
    }
}

/// Two nodes that each take the other for a queue's master (one has not
/// seen a move yet) do not pass work back and forth: a publish and a get
/// from the node this one takes for the master wait here, in order, until
/// this node hears of the move, and are made here if this node is the
/// master now. Before, the publish went back and the get was made first
/// (found nothing) or answered empty. If no move comes in 250 ms, this
/// node was right: the work goes to that node.
#[test]
fn work_from_the_node_taken_for_the_master_waits_for_the_move() {
    let (node, mut c) = Node::session();
    c.queue(1, "q");
    node.with_broker(|b| b.set_queue_master("/", "q", Some("n2")));
    let _ = node.with_broker(warren_broker::Broker::take_link_out);
    let get = |req| LinkMsg::Get {
        vhost: "/".into(),
        queue: "q".into(),
        req,
        no_ack: true,
    };
    let publish = |id| LinkMsg::Publish {
        vhost: "/".into(),
        queue: "q".into(),
        id,
        publisher: 1,
        first: None,
        meta: bytes::Bytes::new(),
        body: bytes::Bytes::from("m"),
        persistent: false,
        expiration_ms: None,
        priority: 0,
    };
    node.with_broker(|b| b.link_input("n2", vec![publish(1), get(3)], START_MS));
    assert_eq!(sent_to(&node, "n2"), [], "neither made nor passed back");
    // This node serves the queue after all: the publish, then the get.
    node.with_broker(|b| b.set_queue_master("/", "q", None));
    let replies = sent_to(&node, "n2");
    assert!(
        matches!(
            &replies[..],
            [LinkMsg::Confirmed { .. }, LinkMsg::GetReply { req: 3, msg: Some(m) }] if m.3 == "m"
        ),
        "{replies:?}"
    );
    // No move heard in 250 ms: the work goes to the node after all.
    node.with_broker(|b| b.set_queue_master("/", "q", Some("n2")));
    node.with_broker(|b| b.link_input("n2", vec![publish(2), get(4)], START_MS));
    node.tick(START_MS + 200);
    assert_eq!(sent_to(&node, "n2"), []);
    node.tick(START_MS + 250);
    let sent = sent_to(&node, "n2");
    assert!(
        matches!(&sent[..], [LinkMsg::Publish { .. }, LinkMsg::Get { .. }]),
        "{sent:?}"
    );
}

/// A delivery for `cid` from the master of `far` (n2, or whichever node
/// feeds it to the broker), tagged `tag`.
fn deliver_from_n2(cid: u64, tag: u64) -> LinkMsg {
    LinkMsg::Deliver {
        cid,
        tag,
        redelivered: false,
        vhost: "/".into(),
        meta: bytes::Bytes::new(),
        body: bytes::Bytes::from(format!("m{tag}")),
    }
}

/// [`far_and_near`] with consumer `t` of `far` on channel 1, which n2 has
/// confirmed; returns its id at n2 too.
fn consuming_far() -> (Node, Client, u64) {
    let (node, mut c) = far_and_near();
    c.send(1, consume_method("far", "t", false));
    let cid = forwarded(&node, |m| match m {
        LinkMsg::Consume { cid, .. } => Some(*cid),
        _ => None,
    });
    answer_from_n2(&node, &mut c, LinkMsg::ConsumeOk { cid });
    (node, c, cid)
}

/// After this node's link state with a queue's master is reset, deliveries
/// the master sent to its consumers before (still on their way over the
/// master's own connection) are dropped, not handed to the client as first
/// deliveries: the master requeues them, redelivered, when it drops this
/// node's link state, and may already have delivered them elsewhere (a lossy
/// link's partition test saw them twice, the second without the flag). The
/// consumer is asked for again under a new id, and what comes for that id
/// is delivered.
#[test]
fn deliveries_from_before_a_link_reset_are_dropped_and_the_consumer_asked_for_again() {
    let (node, mut c, cid) = consuming_far();
    let got = answer_from_n2(&node, &mut c, deliver_from_n2(cid, 1));
    assert_eq!(got, [(60, 60)], "the first delivery");
    node.with_broker(|b| b.link_down("n2", START_MS));
    let got = answer_from_n2(&node, &mut c, deliver_from_n2(cid, 2));
    assert!(got.is_empty(), "a delivery from before the reset: {got:?}");
    node.with_broker(|b| b.resubscribe("n2"));
    let out = sent_to(&node, "n2");
    assert!(
        !out.iter().any(|m| matches!(m, LinkMsg::Settle { .. })),
        "the master requeues it itself: {out:?}"
    );
    let again = out
        .iter()
        .find_map(|m| match m {
            LinkMsg::Consume { cid, .. } => Some(*cid),
            _ => None,
        })
        .expect("the consumer asked for again");
    assert_ne!(again, cid);
    answer_from_n2(&node, &mut c, LinkMsg::ConsumeOk { cid: again });
    let got = answer_from_n2(&node, &mut c, deliver_from_n2(again, 3));
    assert_eq!(got, [(60, 60)], "a delivery of the new session");
}

/// The confirms received so far, as `(kind, delivery tag)`.
fn confirm_kinds(c: &mut Client) -> Vec<(&'static str, u64)> {
    crate::confirms::confirms(c)
        .iter()
        .map(|x| (x.0, x.1))
        .collect()
}

/// A master that gave up its link state with this node before it heard
/// this node's current link session (a restarted node's first session was
/// closed under it, and it dialed again) drops what it had of this node's
/// from before, not what this node sent since: a publish forwarded on the
/// current session is confirmed, not nacked (it was, for about a second
/// after a node's restart). What the master delivered before its give-up it
/// requeued itself, so a client's ack of it settles nowhere.
#[test]
fn a_master_that_gave_up_before_this_nodes_session_keeps_what_came_since() {
    let (node, mut c, cid) = consuming_far();
    let got = answer_from_n2(&node, &mut c, deliver_from_n2(cid, 1));
    assert_eq!(got, [(60, 60)], "a delivery from before the give-up");
    c.open_channel(2);
    c.confirm_select(2);
    c.publish(2, "", "far", Message::new("since"));
    let id = forwarded(&node, |m| match m {
        LinkMsg::Publish { id, .. } => Some(*id),
        _ => None,
    });
    node.with_broker(|b| b.link_peer_gave_up("n2"));
    c.pump();
    assert_eq!(crate::confirms::confirms(&mut c), [], "nothing nacked");
    c.ack(1, 1, false);
    let out = sent_to(&node, "n2");
    assert!(
        !out.iter().any(|m| matches!(m, LinkMsg::Settle { .. })),
        "n2 requeued its delivery itself: {out:?}"
    );
    node.with_broker(|b| b.link_input("n2", vec![LinkMsg::Confirmed { ids: vec![id] }], START_MS));
    c.pump();
    assert_eq!(confirm_kinds(&mut c), [("ack", 1)]);
}

/// What the same gives after a plain link reset (`link_replaced`: the
/// master gave up after it heard this node's session): the publish is
/// nacked.
#[test]
fn a_master_that_gave_up_after_this_nodes_session_nacks_what_it_carried() {
    let (node, mut c, _cid) = consuming_far();
    c.open_channel(2);
    c.confirm_select(2);
    c.publish(2, "", "far", Message::new("lost"));
    let _ = sent_to(&node, "n2");
    node.with_broker(|b| b.link_replaced("n2", START_MS));
    c.pump();
    assert_eq!(confirm_kinds(&mut c), [("nack", 1)]);
}

/// A consumer whose queue moves to a master this node's link with has been
/// reset since the consumer's id was given follows it under a new id: under
/// the old one, a delivery crossing the consumer's cancel would be taken for
/// one of the earlier session's (which the master requeues itself) and
/// dropped, and the master would hold it unacknowledged for ever (chaos
/// seed 57 with four queues). It reaches the client, before the cancel-ok.
#[test]
fn a_consumer_following_its_queue_to_a_master_reset_since_gets_a_new_id() {
    let (node, mut c, cid) = consuming_far();
    // The link with n3 is reset while n2 serves the queue; then n3 takes it.
    node.with_broker(|b| b.link_down("n3", START_MS));
    node.with_broker(|b| b.set_queue_master("/", "far", Some("n3")));
    let moved = sent_to(&node, "n3")
        .iter()
        .find_map(|m| match m {
            LinkMsg::Consume { cid, .. } => Some(*cid),
            _ => None,
        })
        .expect("the consumer asked of n3");
    assert_ne!(moved, cid, "a new id past n3's reset");
    c.send(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
            consumer_tag: "t".into(),
            nowait: false,
        })),
    );
    c.pump();
    assert!(c.drain().is_empty(), "cancel-ok before n3 had the cancel");
    let _ = sent_to(&node, "n3");
    // n3's delivery, sent before it had the cancel, then its cancel-ok.
    let from_n3 = vec![deliver_from_n2(moved, 7), LinkMsg::CancelOk { cid: moved }];
    node.with_broker(|b| b.link_input("n3", from_n3, START_MS));
    c.pump();
    let got: Vec<(u16, u16)> = c.drain().iter().map(Incoming::ids).collect();
    assert_eq!(got, [(60, 60), (60, 31)], "the delivery, then cancel-ok");
    let back = sent_to(&node, "n3");
    assert!(
        !back.iter().any(|m| matches!(m, LinkMsg::Settle { .. })),
        "{back:?}"
    );
}

/// The `cancel-ok` of a forwarded consumer waits for its master's: what
/// the master delivered before it had the cancel reaches the client
/// first, as RabbitMQ's channel delivers what its queue sent before the
/// cancel. Before, those deliveries went back to the master, to come again
/// later flagged redelivered. The master's link going down, or five
/// seconds, answer the cancel anyway.
#[test]
fn a_forwarded_cancel_ok_comes_after_the_masters_last_deliveries() {
    let cancel = |c: &mut Client, tag: &str| {
        c.send(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                consumer_tag: tag.into(),
                nowait: false,
            })),
        );
        c.pump();
        c.drain().iter().map(Incoming::ids).collect::<Vec<_>>()
    };
    let (node, mut c, cid) = consuming_far();
    assert_eq!(cancel(&mut c, "t"), [], "answered before the master's");
    assert!(
        sent_to(&node, "n2")
            .iter()
            .any(|m| matches!(m, LinkMsg::Cancel { cid: x, .. } if *x == cid))
    );
    let got = answer_from_n2(&node, &mut c, deliver_from_n2(cid, 1));
    assert_eq!(got, [(60, 60)], "delivered before the cancel-ok");
    let got = answer_from_n2(&node, &mut c, LinkMsg::CancelOk { cid });
    assert_eq!(got, [(60, 31)]);
    let got = answer_from_n2(&node, &mut c, deliver_from_n2(cid, 2));
    assert_eq!(got, [], "after the cancel-ok: sent back");

    // Unanswered: the link going down answers it, and the clock does.
    for ends in ["link down", "time"] {
        c.send(1, consume_method("far", "t", false));
        let cid = forwarded(&node, |m| match m {
            LinkMsg::Consume { cid, .. } => Some(*cid),
            _ => None,
        });
        answer_from_n2(&node, &mut c, LinkMsg::ConsumeOk { cid });
        assert_eq!(cancel(&mut c, "t"), []);
        if ends == "link down" {
            node.with_broker(|b| b.link_down("n2", START_MS));
        } else {
            node.tick(START_MS + 5_000);
        }
        c.pump();
        let got: Vec<(u16, u16)> = c.drain().iter().map(Incoming::ids).collect();
        assert_eq!(got, [(60, 31)], "{ends}");
    }
}

/// A queue held until its mirrored master starts hands nothing out, and a
/// consumer waits (a get too: `a_held_get_is_made_here_or_answered_empty_in_time`);
/// once no policy mirrors it, this node serves it after all and the
/// consumer gets what it holds.
#[test]
fn a_queue_held_for_its_replica_serves_nothing_until_released() {
    let (node, mut c) = Node::session();
    c.queue(1, "q");
    c.publish(1, "", "q", Message::new("kept"));
    node.with_broker(|b| b.hold_for_replica("/", "q"));
    c.consume(1, "q", "held", false);
    c.pump();
    assert!(c.drain().is_empty(), "a held queue delivered");
    // The reconciler's pass pointing the queue at this node does not serve it.
    node.with_broker(|b| b.set_queue_master("/", "q", None));
    c.pump();
    assert!(c.drain().is_empty(), "a held queue delivered");
    node.with_broker(|b| b.serve_unmirrored("/", "q"));
    c.pump();
    let got = c.drain();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].body, b"kept");
}

/// An `auto-delete` queue whose last consumer leaves while the queue has
/// no master (its master is handing it over) goes with the next master:
/// the origin tells it, after the consumers it still has, as RabbitMQ's
/// master sees every cancel. Before, the queue stayed, bound, and a
/// mandatory publish meant for "no queue" was routed to it (aio-pika's
/// RPC tests against a cluster hung).
#[test]
fn a_consumer_that_leaves_between_masters_is_counted_by_the_next_one() {
    let (node, mut c) = Node::session();
    c.declare_queue(1, "q", QueueOpts::auto_delete()).unwrap();
    c.declare_queue(1, "busy", QueueOpts::auto_delete())
        .unwrap();
    c.queue(1, "plain");
    for (q, tag) in [("q", "t"), ("busy", "b1"), ("busy", "b2"), ("plain", "p")] {
        c.consume(1, q, tag, false);
    }
    node.with_broker(|b| {
        for q in ["q", "busy", "plain"] {
            b.hold_for_replica("/", q);
        }
    });
    for tag in ["t", "b1", "p"] {
        let cancel = AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
            consumer_tag: tag.into(),
            nowait: false,
        }));
        c.call_ok(1, cancel, (60, 31), "basic.cancel-ok");
    }
    let out = node.with_broker(|b| {
        for q in ["q", "busy", "plain"] {
            b.set_queue_master("/", q, Some("n2"));
        }
        b.take_link_out()
    });
    let sent: Vec<(&str, &str)> = out
        .iter()
        .flat_map(|(_, m)| m)
        .filter_map(|m| match m {
            LinkMsg::Consume { queue, .. } => Some(("consume", queue.as_str())),
            LinkMsg::ConsumerLeft { queue, .. } => Some(("left", queue.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(
        sent,
        [("left", "q"), ("consume", "busy"), ("left", "busy")],
        "{out:?}"
    );
}

/// The master told of a consumer that left between masters deletes an
/// `auto-delete` queue with no consumer left; a node told before it knows
/// itself the master counts it once it serves the queue.
#[test]
fn a_master_told_of_a_consumer_that_left_deletes_an_unused_auto_delete_queue() {
    let (node, mut c) = Node::session();
    for q in ["q", "busy", "later"] {
        c.declare_queue(1, q, QueueOpts::auto_delete()).unwrap();
    }
    c.consume(1, "busy", "b", false);
    node.with_broker(|b| b.set_queue_master("/", "later", Some("n3")));
    let left = |q: &str| LinkMsg::ConsumerLeft {
        vhost: "/".into(),
        queue: q.into(),
    };
    node.with_broker(|b| {
        b.link_input("n2", vec![left("q"), left("busy"), left("later")], START_MS);
    });
    let exists = |c: &mut Client, q: &str| match c.declare_queue(2, q, QueueOpts::passive()) {
        Ok(_) => true,
        Err(e) => {
            assert_eq!(e.code, 404, "{e:?}");
            c.open_channel(2);
            false
        }
    };
    c.open_channel(2);
    assert!(!exists(&mut c, "q"), "unused: deleted");
    assert!(exists(&mut c, "busy"), "a consumer is left");
    node.with_broker(|b| b.set_queue_master("/", "later", None));
    assert!(!exists(&mut c, "later"), "counted once served here");
}

/// A `basic.get` of a queue with no master right now (its master handing
/// it over) waits for the next master, after the publishes held for it,
/// whether a client's or another node's; before, it was answered empty
/// while the queue held messages (aio-pika's `test_big_message` against a
/// cluster: a publish, then a get, as the queue's master moved).
#[test]
fn a_get_between_masters_waits_for_the_next_one() {
    let (node, mut c) = Node::session();
    c.queue(1, "q");
    node.with_broker(|b| b.hold_for_replica("/", "q"));
    c.publish(1, "", "q", Message::new("held"));
    c.send(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: "q".into(),
            no_ack: true,
        })),
    );
    c.pump();
    assert!(
        c.drain().is_empty(),
        "answered before the queue has a master"
    );
    let from_n2 = LinkMsg::Get {
        vhost: "/".into(),
        queue: "q".into(),
        req: 9,
        no_ack: true,
    };
    node.with_broker(|b| b.link_input("n2", vec![from_n2], START_MS));
    assert!(sent_to(&node, "n2").is_empty(), "n2's get answered at once");

    node.with_broker(|b| b.set_queue_master("/", "q", Some("n3")));
    let to_n3 = sent_to(&node, "n3");
    let order: Vec<&str> = to_n3
        .iter()
        .filter_map(|m| match m {
            LinkMsg::Publish { .. } => Some("publish"),
            LinkMsg::Get { .. } => Some("get"),
            _ => None,
        })
        .collect();
    assert_eq!(order, ["publish", "get", "get"], "{to_n3:?}");
    let reqs: Vec<u64> = to_n3
        .iter()
        .filter_map(|m| match m {
            LinkMsg::Get { req, .. } => Some(*req),
            _ => None,
        })
        .collect();
    let msg = Some((
        41,
        false,
        bytes::Bytes::new(),
        bytes::Bytes::from("held"),
        0,
    ));
    let replies = replies_from(&node, &mut c, "n3", LinkMsg::GetReply { req: reqs[0], msg });
    assert_eq!(
        replies.iter().map(Incoming::ids).collect::<Vec<_>>(),
        [(60, 71)],
        "get-ok"
    );
    assert_eq!(replies[0].body, b"held");
    let reply = LinkMsg::GetReply {
        req: reqs[1],
        msg: None,
    };
    node.with_broker(|b| b.link_input("n3", vec![reply], START_MS));
    assert!(
        sent_to(&node, "n2")
            .iter()
            .any(|m| matches!(m, LinkMsg::GetReply { req: 9, msg: None })),
        "n2's get answered with n3's answer"
    );
}

/// A get held for a queue's next master is made here if this node serves
/// the queue next, and answered empty after five seconds without a master.
#[test]
fn a_held_get_is_made_here_or_answered_empty_in_time() {
    let (node, mut c) = Node::session();
    c.queue(1, "here");
    c.queue(1, "none");
    c.publish(1, "", "here", Message::new("m"));
    node.with_broker(|b| {
        b.hold_for_replica("/", "here");
        b.hold_for_replica("/", "none");
    });
    for q in ["here", "none"] {
        c.send(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
                queue: q.into(),
                no_ack: true,
            })),
        );
    }
    c.pump();
    assert!(c.drain().is_empty());
    node.with_broker(|b| b.serve_unmirrored("/", "here"));
    c.pump();
    let got = c.drain();
    assert_eq!(
        got.iter().map(Incoming::ids).collect::<Vec<_>>(),
        [(60, 71)]
    );
    assert_eq!(got[0].body, b"m");
    node.tick(START_MS + 4_999);
    c.pump();
    assert!(c.drain().is_empty());
    node.tick(START_MS + 5_000);
    c.pump();
    let got = c.drain();
    assert_eq!(
        got.iter().map(Incoming::ids).collect::<Vec<_>>(),
        [(60, 72)],
        "get-empty"
    );
}

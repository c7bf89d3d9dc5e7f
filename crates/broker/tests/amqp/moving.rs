//! A client connection moving to the sibling shard that masters its first
//! queue (`moving.rs`): two brokers as the shards of one node, each with
//! the other as its sibling.

use std::sync::Arc;

use warren_amqp::amq_protocol::types::FieldTable;

use crate::support::{Message, Node};

/// Shard 0 (`w`) serving queue `q`, and shard 1 (`w/shard1`) knowing `q`
/// as shard 0's.
fn two_shards() -> (Node, Node) {
    let zero = Node::with_config(|c| {
        c.node_name = "w".into();
        c.siblings = vec![Arc::from("w/shard1")];
    });
    let one = Node::with_config(|c| {
        c.node_name = "w/shard1".into();
        c.siblings = vec![Arc::from("w")];
    });
    let mut owner = zero.connect();
    owner.open_channel(1);
    owner.queue(1, "q");
    one.with_broker(|b| {
        b.admin_declare_queue("/", "q", false, false, FieldTable::default())
            .expect("declare");
        b.set_queue_master("/", "q", Some("w"));
    });
    (zero, one)
}

/// Shard 1 sent work over its link to shard 0.
fn assert_forwarded_to_shard_0(one: &Node) {
    let out = one.with_broker(|b| b.take_link_out());
    assert!(
        out.iter()
            .any(|(node, msgs)| node == "w" && !msgs.is_empty()),
        "the publish went over the link to shard 0: {out:?}"
    );
}

#[test]
fn a_publisher_moves_to_the_shard_of_its_queue_and_is_confirmed_there() {
    let (zero, one) = two_shards();
    let mut c = one.connect();
    c.allow_moving();
    c.open_channel(1);
    c.confirm_select(1);
    c.publish(1, "", "q", Message::new("first"));
    assert_eq!(c.moving().as_deref(), Some("w"), "it asks to move");
    c.move_to(&zero);
    // The publish set aside went into shard 0's queue and was confirmed
    // there; nothing went over the link.
    let ack = c.recv_on(1);
    assert_eq!(ack.ids(), (60, 80), "basic.ack");
    c.publish(1, "", "q", Message::new("second"));
    assert_eq!(c.recv_on(1).ids(), (60, 80), "basic.ack");
    assert!(c.moving().is_none(), "it is placed for good");
    assert_eq!(c.counts(1, "q"), (2, 0));
    assert!(
        one.with_broker(|b| b.take_link_out()).is_empty(),
        "nothing was forwarded"
    );
    assert_eq!(c.get_body(1, "q").as_deref(), Some(&b"first"[..]));
}

#[test]
fn a_consumer_moves_before_its_consume_and_gets_the_queues_messages() {
    let (zero, one) = two_shards();
    let mut p = zero.connect();
    p.open_channel(1);
    p.publish(1, "", "q", Message::new("waiting"));
    let mut c = one.connect();
    c.allow_moving();
    c.open_channel(1);
    c.qos(1, 10, false);
    c.send(
        1,
        warren_amqp::amq_protocol::protocol::AMQPClass::Basic(
            warren_amqp::amq_protocol::protocol::basic::AMQPMethod::Consume(
                warren_amqp::amq_protocol::protocol::basic::Consume {
                    queue: "q".into(),
                    consumer_tag: "t".into(),
                    ..Default::default()
                },
            ),
        ),
    );
    assert_eq!(c.moving().as_deref(), Some("w"));
    c.move_to(&zero);
    assert_eq!(c.recv_on(1).ids(), (60, 21), "basic.consume-ok");
    let d = c.recv_on(1);
    assert_eq!(d.ids(), (60, 60), "basic.deliver");
}

#[test]
fn a_connection_whose_shell_cannot_move_it_is_forwarded() {
    let (_zero, one) = two_shards();
    let mut c = one.connect();
    c.open_channel(1);
    c.publish(1, "", "q", Message::new("far"));
    assert!(c.moving().is_none());
    assert_forwarded_to_shard_0(&one);
}

#[test]
fn a_connection_holding_work_on_its_shard_stays_and_is_forwarded() {
    let (_zero, one) = two_shards();
    let mut c = one.connect();
    c.allow_moving();
    c.open_channel(1);
    // A queue of its own shard first: it is placed here.
    c.queue(1, "local");
    c.publish(1, "", "q", Message::new("far"));
    assert!(c.moving().is_none());
    assert_forwarded_to_shard_0(&one);
}

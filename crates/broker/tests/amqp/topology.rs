//! Declaring, redeclaring, deleting and binding exchanges and queues
//! (`broker/topology.rs`, `broker/args.rs`).

use warren_amqp::amq_protocol::protocol::{AMQPClass, exchange, queue};
use warren_amqp::amq_protocol::types::{AMQPValue, FieldTable};

use crate::support::{Message, Node, QueueOpts};

#[test]
fn declare_ok_counts_ready_messages_and_consumers() {
    let (_node, mut c) = Node::session();
    assert_eq!(
        c.declare_queue(1, "q", QueueOpts::default()),
        Ok(("q".into(), 0, 0))
    );
    for i in 0..3 {
        c.publish(1, "", "q", Message::new(&format!("m{i}")));
    }
    assert_eq!(
        c.declare_queue(1, "q", QueueOpts::passive()),
        Ok(("q".into(), 3, 0))
    );
    // A consumer on another channel takes the three (unacked, so no
    // longer ready) and counts as one consumer.
    c.open_channel(2);
    c.consume(2, "q", "ctag", false);
    assert_eq!(c.drain().len(), 3, "three deliveries");
    assert_eq!(
        c.declare_queue(1, "q", QueueOpts::default()),
        Ok(("q".into(), 0, 1))
    );
}

#[test]
fn a_server_named_queue_is_named_amq_gen() {
    let (_node, mut c) = Node::session();
    let (name, _, _) = c
        .declare_queue(
            1,
            "",
            QueueOpts {
                exclusive: true,
                ..QueueOpts::default()
            },
        )
        .unwrap();
    assert!(name.starts_with("amq.gen-"), "{name}");
    // An empty name means the channel's last declared queue.
    assert_eq!(
        c.declare_queue(1, "", QueueOpts::passive()),
        Ok((name, 0, 0))
    );
}

#[test]
fn passive_declare_of_a_missing_queue_closes_the_channel_with_404() {
    let (_node, mut c) = Node::session();
    let e = c
        .declare_queue(1, "nope", QueueOpts::passive())
        .unwrap_err();
    assert!(!e.connection);
    assert_eq!(e.code, 404);
    assert_eq!(e.text, "NOT_FOUND - no queue 'nope' in vhost '/'");
    assert_eq!((e.class_id, e.method_id), (50, 10));
    // The channel can be opened again; the connection lives on.
    c.open_channel(1);
}

#[test]
fn redeclaring_a_queue_with_other_arguments_is_406() {
    let (_node, mut c) = Node::session();
    let ttl = |ms| QueueOpts::default().arg("x-message-ttl", AMQPValue::LongInt(ms));
    c.declare_queue(1, "q", ttl(1000)).unwrap();
    c.declare_queue(1, "q", ttl(1000))
        .expect("the same arguments");
    let e = c.declare_queue(1, "q", ttl(2000)).unwrap_err();
    assert_eq!(e.code, 406);
    assert!(
        e.text.starts_with(
            "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/'"
        ),
        "{}",
        e.text
    );
    c.open_channel(1);
    let e = c.declare_queue(1, "q", QueueOpts::durable()).unwrap_err();
    assert_eq!(e.code, 406);
    assert!(e.text.contains("inequivalent arg 'durable'"), "{}", e.text);
}

#[test]
fn an_invalid_queue_argument_is_406() {
    let (node, mut c) = Node::session();
    let opts = QueueOpts::default().arg("x-max-length", AMQPValue::LongInt(-1));
    let e = c.declare_queue(1, "q", opts).unwrap_err();
    assert_eq!(e.code, 406);
    assert!(e.text.contains("invalid arg 'x-max-length'"), "{}", e.text);
    assert!(node.queue_names().is_empty());
}

#[test]
fn x_queue_mode_takes_default_or_lazy() {
    // RabbitMQ 3.10: a long string, one of the two (its text recorded by
    // the conformance scenario queue_mode).
    let (node, mut c) = Node::session();
    for mode in ["default", "lazy"] {
        let opts = QueueOpts::durable().arg("x-queue-mode", AMQPValue::LongString(mode.into()));
        c.declare_queue(1, mode, opts).expect("declare");
    }
    let opts = QueueOpts::default().arg("x-queue-mode", AMQPValue::LongString("eager".into()));
    let e = c.declare_queue(1, "q", opts).unwrap_err();
    assert_eq!(e.code, 406);
    assert_eq!(
        e.text,
        "PRECONDITION_FAILED - invalid arg 'x-queue-mode' for queue 'q' in vhost '/': \"unsupported queue mode 'eager'\""
    );
    assert_eq!(node.queue_names(), ["default", "lazy"]);
}

#[test]
fn redeclaring_an_exchange_with_another_type_is_406() {
    let (_node, mut c) = Node::session();
    c.declare_exchange(1, "x", "direct", false, FieldTable::default())
        .unwrap();
    let e = c
        .declare_exchange(1, "x", "fanout", false, FieldTable::default())
        .unwrap_err();
    assert_eq!(e.code, 406);
    assert_eq!(
        e.text,
        "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'x' in vhost '/': received 'fanout' but current is 'direct'"
    );
    assert_eq!((e.class_id, e.method_id), (40, 10));
}

#[test]
fn the_amq_prefix_is_reserved() {
    let (_node, mut c) = Node::session();
    let e = c
        .declare_exchange(1, "amq.mine", "direct", false, FieldTable::default())
        .unwrap_err();
    assert_eq!(e.code, 403);
    c.open_channel(1);
    let e = c
        .declare_queue(1, "amq.mine", QueueOpts::default())
        .unwrap_err();
    assert_eq!(e.code, 403);
}

#[test]
fn exchange_delete_if_unused_refuses_an_exchange_with_bindings() {
    let (_node, mut c) = Node::session();
    c.declare_exchange(1, "x", "direct", false, FieldTable::default())
        .unwrap();
    c.queue(1, "q");
    c.bind(1, "q", "x", "k", FieldTable::default()).unwrap();
    let delete = |if_unused| {
        AMQPClass::Exchange(exchange::AMQPMethod::Delete(exchange::Delete {
            exchange: "x".into(),
            if_unused,
            nowait: false,
        }))
    };
    let e = c.call(1, delete(true)).unwrap_err();
    assert_eq!(e.code, 406);
    assert_eq!(
        e.text,
        "PRECONDITION_FAILED - exchange 'x' in vhost '/' in use"
    );
    c.open_channel(1);
    let ok = c.call(1, delete(false)).unwrap();
    assert_eq!(ok.ids(), (40, 21));
    // Gone: publishing to it is 404.
    c.publish(1, "x", "k", Message::new("m"));
    assert_eq!(c.expect_close(1).code, 404);
}

#[test]
fn queue_delete_if_unused_refuses_a_queue_with_consumers_and_counts_what_it_drops() {
    let (node, mut c) = Node::session();
    c.queue(1, "q");
    c.publish(1, "", "q", Message::new("a"));
    c.publish(1, "", "q", Message::new("b"));
    c.open_channel(2);
    c.consume(2, "q", "ctag", false);
    let delete = |if_unused, if_empty| {
        AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
            queue: "q".into(),
            if_unused,
            if_empty,
            nowait: false,
        }))
    };
    let e = c.call(1, delete(true, false)).unwrap_err();
    assert_eq!(e.code, 406);
    assert_eq!(
        e.text,
        "PRECONDITION_FAILED - queue 'q' in vhost '/' in use"
    );
    // The consumer goes: its two deliveries are requeued with its channel.
    c.drain();
    c.close_channel(2);
    c.drain();
    c.open_channel(1);
    let e = c.call(1, delete(false, true)).unwrap_err();
    assert_eq!(
        e.text,
        "PRECONDITION_FAILED - queue 'q' in vhost '/' not empty"
    );
    c.open_channel(1);
    let ok = c.call(1, delete(true, false)).unwrap();
    let AMQPClass::Queue(queue::AMQPMethod::DeleteOk(ok)) = ok.method else {
        panic!("expected queue.delete-ok, got {ok:?}");
    };
    assert_eq!(ok.message_count, 2);
    assert!(node.queue_names().is_empty());
}

#[test]
fn an_exclusive_queue_is_locked_to_its_connection_and_goes_with_it() {
    let node = Node::new();
    let mut owner = node.connect();
    owner.open_channel(1);
    let exclusive = QueueOpts {
        exclusive: true,
        ..QueueOpts::default()
    };
    owner.declare_queue(1, "mine", exclusive.clone()).unwrap();
    let mut other = node.connect();
    other.open_channel(1);
    let e = other.declare_queue(1, "mine", exclusive).unwrap_err();
    assert_eq!(e.code, 405);
    assert!(
        e.text
            .starts_with("RESOURCE_LOCKED - cannot obtain exclusive access to locked queue 'mine'"),
        "{}",
        e.text
    );
    other.open_channel(1);
    let e = other.get(1, "mine", true).unwrap_err();
    assert_eq!(e.code, 405);
    assert_eq!(node.queue_names(), ["mine"]);
    node.disconnect(&owner);
    assert!(node.queue_names().is_empty());
}

#[test]
fn binding_to_a_missing_queue_or_exchange_is_404() {
    let (_node, mut c) = Node::session();
    let e = c
        .bind(1, "nope", "amq.direct", "k", FieldTable::default())
        .unwrap_err();
    assert_eq!(e.code, 404);
    assert_eq!(e.text, "NOT_FOUND - no queue 'nope' in vhost '/'");
    c.open_channel(1);
    c.queue(1, "q");
    let e = c
        .bind(1, "q", "nope", "k", FieldTable::default())
        .unwrap_err();
    assert_eq!(e.code, 404);
    assert_eq!(e.text, "NOT_FOUND - no exchange 'nope' in vhost '/'");
}

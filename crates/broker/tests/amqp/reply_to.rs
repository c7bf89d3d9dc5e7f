//! RabbitMQ's direct reply-to (`broker/reply_to.rs`): a request's
//! `reply_to` names the requesting channel, and a reply goes straight to
//! that channel's `amq.rabbitmq.reply-to` consumer.

use warren_amqp::amq_protocol::protocol::{AMQPClass, basic};

use crate::support::{Message, Node, QueueOpts, consume_method};

#[test]
fn a_reply_goes_straight_to_the_requesting_channels_consumer() {
    let (_node, mut c) = Node::session();
    c.queue(1, "rpc");
    c.open_channel(2);
    c.consume(2, "amq.rabbitmq.reply-to", "replies", true);
    let mut request = Message::new("ping");
    request.properties = request
        .properties
        .with_reply_to("amq.rabbitmq.reply-to".into())
        .with_correlation_id("c1".into());
    c.publish(2, "", "rpc", request);
    // The server side: the request names the channel to answer.
    let got = c.get(1, "rpc", true).expect("basic.get");
    let reply_to = got
        .properties
        .as_ref()
        .and_then(|p| p.reply_to().clone())
        .expect("a reply_to")
        .to_string();
    assert!(
        reply_to.starts_with("amq.rabbitmq.reply-to.") && reply_to.len() > 30,
        "{reply_to}"
    );
    let mut reply = Message::new("pong");
    reply.properties = reply.properties.with_correlation_id("c1".into());
    c.publish(1, "", &reply_to, reply.clone());
    let inc = c.drain();
    assert_eq!(inc.len(), 1, "{inc:?}");
    let AMQPClass::Basic(basic::AMQPMethod::Deliver(d)) = &inc[0].method else {
        panic!("expected a delivery, got {inc:?}");
    };
    assert_eq!(
        (
            inc[0].channel,
            d.consumer_tag.as_str(),
            d.routing_key.as_str()
        ),
        (2, "replies", reply_to.as_str())
    );
    assert_eq!(inc[0].body, b"pong");
    // Mandatory: delivered, and returned too, for it reached no queue
    // (RabbitMQ's documented behaviour).
    c.publish(1, "", &reply_to, reply.clone().mandatory());
    let ids: Vec<(u16, (u16, u16))> = c.drain().iter().map(|i| (i.channel, i.ids())).collect();
    assert_eq!(ids, [(2, (60, 60)), (1, (60, 50))]);
    // Its address is a queue to queue.declare while the consumer lasts
    // (RabbitMQ's declare-ok: no messages, one consumer).
    assert_eq!(c.counts(1, &reply_to), (0, 1));
    c.queue(1, "amq.rabbitmq.reply-to");
    // Its consumer cancelled, a reply to it has nowhere to go.
    let cancel = AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
        consumer_tag: "replies".into(),
        nowait: false,
    }));
    c.call_ok(2, cancel, (60, 31), "basic.cancel-ok");
    c.publish(1, "", &reply_to, reply.mandatory());
    let inc = c.drain();
    assert!(
        matches!(&inc[..], [i] if matches!(i.method, AMQPClass::Basic(basic::AMQPMethod::Return(_)))),
        "{inc:?}"
    );
    let e = c
        .declare_queue(1, &reply_to, QueueOpts::passive())
        .unwrap_err();
    assert_eq!(e.code, 404, "{e:?}");
}

#[test]
fn direct_reply_to_is_refused_as_in_rabbitmq() {
    let (_node, mut c) = Node::session();
    c.queue(1, "rpc");
    // No acks on the pseudo-queue.
    let e = c
        .call(1, consume_method("amq.rabbitmq.reply-to", "r", false))
        .unwrap_err();
    assert_eq!(
        (e.code, e.text.as_str()),
        (
            406,
            "PRECONDITION_FAILED - reply consumer cannot acknowledge"
        )
    );
    // A request naming it from a channel without its consumer.
    c.open_channel(2);
    let mut request = Message::new("ping");
    request.properties = request
        .properties
        .with_reply_to("amq.rabbitmq.reply-to".into());
    c.publish(2, "", "rpc", request);
    let e = c.expect_close(2);
    assert_eq!(
        (e.code, e.text.as_str()),
        (
            406,
            "PRECONDITION_FAILED - fast reply consumer does not exist"
        )
    );
    // One such consumer per channel.
    c.open_channel(3);
    c.consume(3, "amq.rabbitmq.reply-to", "r1", true);
    let e = c
        .call(3, consume_method("amq.rabbitmq.reply-to", "r2", true))
        .unwrap_err();
    assert_eq!(
        (e.code, e.text.as_str()),
        (406, "PRECONDITION_FAILED - reply consumer already set")
    );
}

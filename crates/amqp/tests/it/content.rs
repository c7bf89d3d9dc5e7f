//! Content assembly (publish) and splitting (deliver, get-ok, return), commands and replies.

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{AMQPClass, BasicProperties, basic, confirm, queue};
use amq_protocol::types::{AMQPValue, FieldTable};
use warren_amqp::{Command, Config, ContentMethod, Event, Publish, Reply};

use crate::{Harness, body, channel_open, header, method, publish};

fn published(h: &mut Harness) -> Vec<Publish> {
    h.events()
        .into_iter()
        .map(|e| match e {
            Event::Command {
                channel: 1,
                command: Command::BasicPublish(p),
            } => p,
            other => panic!("expected a publish, got {other:?}"),
        })
        .collect()
}

#[test]
fn publish_in_one_body_frame() {
    let mut h = Harness::with_channel(1);
    let props = BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("text/plain".into());
    let mut bytes = publish(1, "amq.direct", "rk");
    bytes.extend(header(1, 5, props.clone()));
    bytes.extend(body(1, b"hello"));
    h.send(&bytes);
    let p = published(&mut h);
    assert_eq!(
        p,
        vec![Publish {
            exchange: "amq.direct".into(),
            routing_key: "rk".into(),
            mandatory: false,
            properties: props,
            body: bytes::Bytes::from_static(b"hello"),
            confirm_seq: None,
        }]
    );
    assert!(h.output().is_empty(), "publish has no reply");
}

#[test]
fn publish_across_body_frames_and_byte_by_byte() {
    let mut h = Harness::with_channel(1);
    let payload: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
    let mut bytes = publish(1, "", "q");
    bytes.extend(header(1, payload.len() as u64, BasicProperties::default()));
    for chunk in payload.chunks(3000) {
        bytes.extend(body(1, chunk));
    }
    for b in &bytes {
        h.send(std::slice::from_ref(b));
    }
    let p = published(&mut h);
    assert_eq!(p.len(), 1);
    assert_eq!(&p[0].body[..], &payload[..]);
}

#[test]
fn empty_body_completes_at_header() {
    let mut h = Harness::with_channel(1);
    h.send(&publish(1, "", "q"));
    h.send(&header(1, 0, BasicProperties::default()));
    let p = published(&mut h);
    assert_eq!(p.len(), 1);
    assert!(p[0].body.is_empty());
}

#[test]
fn publishes_interleave_across_channels() {
    let mut h = Harness::with_channel(1);
    h.send(&channel_open(2));
    h.events();
    let mut bytes = publish(1, "", "a");
    bytes.extend(publish(2, "", "b"));
    bytes.extend(header(2, 1, BasicProperties::default()));
    bytes.extend(header(1, 1, BasicProperties::default()));
    bytes.extend(body(1, b"1"));
    bytes.extend(body(2, b"2"));
    h.send(&bytes);
    let ev = h.events();
    let got: Vec<(u16, String, Vec<u8>)> = ev
        .into_iter()
        .map(|e| match e {
            Event::Command {
                channel,
                command: Command::BasicPublish(p),
            } => (channel, p.routing_key.to_string(), p.body.to_vec()),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (1, "a".into(), b"1".to_vec()),
            (2, "b".into(), b"2".to_vec())
        ]
    );
}

#[test]
fn confirm_mode_numbers_publishes() {
    let mut h = Harness::with_channel(1);
    h.send(&method(
        1,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
    ));
    assert!(matches!(
        h.events().as_slice(),
        [Event::Command {
            command: Command::ConfirmSelect(_),
            ..
        }]
    ));
    assert!(h.conn.reply(1, Reply::ConfirmSelectOk));
    let mut bytes = Vec::new();
    for _ in 0..3 {
        bytes.extend(publish(1, "", "q"));
        bytes.extend(header(1, 1, BasicProperties::default()));
        bytes.extend(body(1, b"x"));
    }
    h.send(&bytes);
    let seqs: Vec<_> = published(&mut h).iter().map(|p| p.confirm_seq).collect();
    assert_eq!(seqs, vec![Some(1), Some(2), Some(3)]);
    assert!(h.conn.reply(
        1,
        Reply::Ack {
            delivery_tag: 2,
            multiple: true
        }
    ));
    assert!(h.conn.reply(
        1,
        Reply::Nack {
            delivery_tag: 3,
            multiple: false
        }
    ));
    let frames = h.frames();
    assert_eq!(
        frames,
        vec![
            AMQPFrame::Method(
                1,
                AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {}))
            ),
            AMQPFrame::Method(
                1,
                AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                    delivery_tag: 2,
                    multiple: true
                }))
            ),
            AMQPFrame::Method(
                1,
                AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                    delivery_tag: 3,
                    multiple: false,
                    requeue: false
                }))
            ),
        ]
    );
}

#[test]
fn queue_declare_command_and_reply() {
    let mut h = Harness::with_channel(1);
    let mut args = FieldTable::default();
    args.insert("x-message-ttl".into(), AMQPValue::LongInt(1000));
    let declare = queue::Declare {
        queue: "q1".into(),
        passive: false,
        durable: true,
        exclusive: false,
        auto_delete: false,
        nowait: false,
        arguments: args,
    };
    h.send(&method(
        1,
        AMQPClass::Queue(queue::AMQPMethod::Declare(declare.clone())),
    ));
    assert_eq!(
        h.events(),
        vec![Event::Command {
            channel: 1,
            command: Command::QueueDeclare(declare)
        }]
    );
    assert!(h.conn.reply(
        1,
        Reply::QueueDeclareOk {
            queue: "q1".into(),
            message_count: 7,
            consumer_count: 2
        }
    ));
    assert_eq!(
        h.one_method(),
        (
            1,
            AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                queue: "q1".into(),
                message_count: 7,
                consumer_count: 2
            }))
        )
    );
    assert!(
        !h.conn.reply(9, Reply::QueueBindOk),
        "channel 9 is not open"
    );
}

fn split_props() -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert("k".into(), AMQPValue::LongString("v".into()));
    BasicProperties::default()
        .with_headers(headers)
        .with_message_id("m-1".into())
        .with_priority(3)
}

#[test]
fn deliver_is_split_by_frame_max() {
    let mut h = Harness::open_with(Config::default(), 4096, 0);
    h.send(&channel_open(1));
    h.events();
    h.output();
    let payload: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
    assert!(h.conn.send_content(
        1,
        &ContentMethod::Deliver {
            consumer_tag: "ctag-1",
            delivery_tag: 42,
            redelivered: true,
            exchange: "ex",
            routing_key: "rk",
        },
        &split_props(),
        &payload,
    ));
    let frames = h.frames();
    assert_eq!(frames.len(), 2 + 3);
    assert_eq!(
        frames[0],
        AMQPFrame::Method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                consumer_tag: "ctag-1".into(),
                delivery_tag: 42,
                redelivered: true,
                exchange: "ex".into(),
                routing_key: "rk".into(),
            }))
        )
    );
    let AMQPFrame::Header(1, hdr) = &frames[1] else {
        panic!("{:?}", frames[1]);
    };
    assert_eq!((hdr.class_id, hdr.body_size), (60, 10_000));
    assert_eq!(hdr.properties, split_props());
    let mut got = Vec::new();
    let mut sizes = Vec::new();
    for f in &frames[2..] {
        let AMQPFrame::Body(1, b) = f else {
            panic!("{f:?}")
        };
        sizes.push(b.len());
        got.extend_from_slice(b);
    }
    assert_eq!(sizes, vec![4088, 4088, 1824]);
    assert_eq!(got, payload);
}

#[test]
fn empty_deliver_has_no_body_frame_and_get_ok_and_return_encode() {
    let mut h = Harness::with_channel(1);
    h.conn.send_content(
        1,
        &ContentMethod::GetOk {
            delivery_tag: 1,
            redelivered: false,
            exchange: "",
            routing_key: "q",
            message_count: 9,
        },
        &BasicProperties::default(),
        b"",
    );
    h.conn.send_content(
        1,
        &ContentMethod::Return {
            reply_code: 312,
            reply_text: "NO_ROUTE",
            exchange: "ex",
            routing_key: "nowhere",
        },
        &BasicProperties::default(),
        b"abc",
    );
    h.conn.reply(1, Reply::BasicGetEmpty);
    let frames = h.frames();
    assert_eq!(frames.len(), 2 + 3 + 1, "{frames:?}");
    assert_eq!(
        frames[0],
        AMQPFrame::Method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::GetOk(basic::GetOk {
                delivery_tag: 1,
                redelivered: false,
                exchange: "".into(),
                routing_key: "q".into(),
                message_count: 9,
            }))
        )
    );
    assert_eq!(
        frames[2],
        AMQPFrame::Method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
                reply_code: 312,
                reply_text: "NO_ROUTE".into(),
                exchange: "ex".into(),
                routing_key: "nowhere".into(),
            }))
        )
    );
    assert_eq!(frames[4], AMQPFrame::Body(1, b"abc".to_vec()));
}

#[test]
fn unlimited_frame_max_sends_one_body_frame() {
    let config = Config {
        frame_max: 0,
        ..Config::default()
    };
    let mut h = Harness::open_with(config, 0, 0);
    h.send(&channel_open(1));
    h.events();
    h.output();
    let payload = vec![1u8; 300_000];
    h.conn.send_content(
        1,
        &ContentMethod::Deliver {
            consumer_tag: "c",
            delivery_tag: 1,
            redelivered: false,
            exchange: "",
            routing_key: "q",
        },
        &BasicProperties::default(),
        &payload,
    );
    assert_eq!(h.frames().len(), 3);
}

#[test]
fn cancel_and_blocked_follow_client_capabilities() {
    let mut h = Harness::with_channel(1);
    assert!(h.conn.cancel_consumer(1, "ctag"));
    assert_eq!(
        h.one_method(),
        (
            1,
            AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                consumer_tag: "ctag".into(),
                nowait: true
            }))
        )
    );
    assert!(h.conn.block("low on memory"));
    assert!(!h.conn.block("again"), "already blocked");
    assert!(h.conn.is_blocked());
    assert!(h.conn.unblock());
    let frames = h.frames();
    assert_eq!(frames.len(), 2);
    // A client without the capabilities gets neither.
    let mut h = Harness::new(Config::default());
    h.send(b"AMQP\x00\x00\x09\x01");
    h.send(&crate::start_ok("u", "p", false));
    h.events();
    h.conn.accept_login();
    h.send(&crate::tune_ok(2047, 131_072, 0));
    h.send(&crate::open("/"));
    h.events();
    h.conn.accept_vhost();
    h.send(&channel_open(1));
    h.output();
    assert!(!h.conn.cancel_consumer(1, "ctag"));
    assert!(!h.conn.block("x"));
    assert!(h.output().is_empty());
}

#[test]
fn access_request_is_answered_by_the_state_machine() {
    use amq_protocol::protocol::access;
    let mut h = Harness::with_channel(1);
    h.send(&method(
        1,
        AMQPClass::Access(access::AMQPMethod::Request(access::Request {
            realm: "/data".into(),
            exclusive: false,
            passive: true,
            active: true,
            write: true,
            read: true,
        })),
    ));
    assert!(h.events().is_empty());
    assert!(matches!(
        h.one_method(),
        (1, AMQPClass::Access(access::AMQPMethod::RequestOk(_)))
    ));
}

#[test]
fn held_publishes_stop_after_the_content_header_until_released() {
    let mut h = Harness::with_channel(1);
    h.conn.hold_publishes(true);
    // Method, header and body arrive together: input stops after the header.
    let mut bytes = publish(1, "", "q");
    bytes.extend_from_slice(&header(1, 4, BasicProperties::default()));
    bytes.extend_from_slice(&body(1, b"abcd"));
    h.send(&bytes);
    assert!(h.events().is_empty(), "no publish while held");
    assert_eq!(h.pending_input(), 12, "the body frame stays unread");
    h.conn.hold_publishes(false);
    h.resume();
    let events = h.events();
    assert!(
        matches!(events.as_slice(), [Event::Command { channel: 1, .. }]),
        "{events:?}"
    );
    assert_eq!(h.pending_input(), 0);
}

//! Field tables and arrays nested without bound are refused before any
//! parser recurses into them: in start-ok, in every method with arguments
//! and in message headers. Once they aborted the process (stack overflow).

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{AMQPClass, BasicProperties, basic, connection, exchange, queue};
use amq_protocol::types::{AMQPValue, FieldTable};
use proptest::prelude::*;
use warren_amqp::{Config, Event, MAX_FIELD_DEPTH};

use crate::{Harness, header, method, publish};

/// A field table whose encoding nests `kinds.len() + 1` levels: the outer
/// table, then one container per entry of `kinds` (`true`: a table, `false`:
/// an array), each the only field of the one around it. Built outside in,
/// in linear time, so that 100,000 levels are cheap.
fn nested(kinds: &[bool]) -> Vec<u8> {
    // Bytes each level adds to its parent's content: a name if the parent
    // is a table, the type octet, the length.
    let parent_named = |i: usize| i == 0 || kinds[i - 1];
    let own: Vec<usize> = (0..kinds.len())
        .map(|i| if parent_named(i) { 2 } else { 0 } + 5)
        .collect();
    let mut below: Vec<usize> = vec![0; kinds.len() + 1];
    for i in (0..kinds.len()).rev() {
        below[i] = below[i + 1] + own[i];
    }
    let mut out = (below[0] as u32).to_be_bytes().to_vec();
    for (i, &table) in kinds.iter().enumerate() {
        if parent_named(i) {
            out.extend_from_slice(&[1, b'k']);
        }
        out.push(if table { b'F' } else { b'A' });
        out.extend_from_slice(&(below[i + 1] as u32).to_be_bytes());
    }
    out
}

/// A method frame from raw argument bytes.
fn raw_method(ch: u16, class_id: u16, method_id: u16, args: &[u8]) -> Vec<u8> {
    let mut payload = class_id.to_be_bytes().to_vec();
    payload.extend_from_slice(&method_id.to_be_bytes());
    payload.extend_from_slice(args);
    let mut out = vec![1];
    out.extend_from_slice(&ch.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(&payload);
    out.push(0xCE);
    out
}

/// queue.declare "q" with raw argument bytes.
fn declare_with(args: &[u8]) -> Vec<u8> {
    let mut fields = vec![0, 0, 1, b'q', 0];
    fields.extend_from_slice(args);
    raw_method(1, 50, 10, &fields)
}

/// A content header whose only property is `headers`, as raw bytes.
fn header_with(headers: &[u8]) -> Vec<u8> {
    let mut payload = vec![0, 60, 0, 0];
    payload.extend_from_slice(&0u64.to_be_bytes());
    payload.extend_from_slice(&(1u16 << 13).to_be_bytes());
    payload.extend_from_slice(headers);
    let mut out = vec![2, 0, 1];
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(&payload);
    out.push(0xCE);
    out
}

/// A table nested `depth` levels deep, built with amq-protocol's types.
fn deep_value(depth: usize) -> FieldTable {
    let mut t = FieldTable::default();
    for _ in 1..depth {
        let mut outer = FieldTable::default();
        outer.insert("k".into(), AMQPValue::FieldTable(t));
        t = outer;
    }
    t
}

fn expect_502(h: &mut Harness, what: &str) {
    let frames = h.frames();
    let closed = frames.iter().any(|f| {
        matches!(f, AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(c)))
            if c.reply_code == 502 && c.reply_text.as_str().contains("nested deeper than 32"))
    });
    assert!(
        closed,
        "{what}: expected connection.close 502, got {frames:?}"
    );
}

#[test]
fn a_huge_start_ok_is_refused_before_tune_by_the_frame_floor() {
    // 1,500 tables deep, 10.5 KB: over RabbitMQ's 4,096-byte pre-tune frame_max.
    let mut h = Harness::new(Config::default());
    h.send(b"AMQP\x00\x00\x09\x01");
    h.output();
    let mut args = nested(&[true; 1500]);
    args.extend_from_slice(&[5, b'P', b'L', b'A', b'I', b'N', 0, 0, 0, 0, 0]);
    h.send(&raw_method(0, 10, 11, &args));
    // Before tune-ok, refused as RabbitMQ refuses: no connection.close.
    assert!(h.output().is_empty());
    assert_eq!(h.expect_refused().code.code(), 501);
}

#[test]
fn a_deep_start_ok_within_the_frame_floor_is_refused_with_502() {
    // Arrays nest in 5 bytes a level: 800 fit in 4,096 bytes.
    let mut h = Harness::new(Config::default());
    h.send(b"AMQP\x00\x00\x09\x01");
    h.output();
    let mut kinds = vec![false; 800];
    kinds[0] = true;
    let mut args = nested(&kinds);
    args.extend_from_slice(&[5, b'P', b'L', b'A', b'I', b'N', 0, 0, 0, 0, 0]);
    h.send(&raw_method(0, 10, 11, &args));
    assert!(h.output().is_empty(), "nothing answered before tune-ok");
    let e = h.expect_refused();
    assert_eq!(e.code.code(), 502, "no login for a refused start-ok");
    assert!(e.text.contains("nested deeper than 32"), "{e:?}");
}

#[test]
fn every_method_with_arguments_is_checked() {
    let args = deep_value(MAX_FIELD_DEPTH + 1);
    let methods = [
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
            exchange: "x".into(),
            kind: "direct".into(),
            arguments: args.clone(),
            ..Default::default()
        })),
        AMQPClass::Exchange(exchange::AMQPMethod::Bind(exchange::Bind {
            destination: "d".into(),
            source: "s".into(),
            routing_key: "k".into(),
            arguments: args.clone(),
            ..Default::default()
        })),
        AMQPClass::Exchange(exchange::AMQPMethod::Unbind(exchange::Unbind {
            destination: "d".into(),
            source: "s".into(),
            routing_key: "k".into(),
            arguments: args.clone(),
            ..Default::default()
        })),
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "q".into(),
            arguments: args.clone(),
            ..Default::default()
        })),
        AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
            queue: "q".into(),
            exchange: "x".into(),
            routing_key: "k".into(),
            arguments: args.clone(),
            ..Default::default()
        })),
        AMQPClass::Queue(queue::AMQPMethod::Unbind(queue::Unbind {
            queue: "q".into(),
            exchange: "x".into(),
            routing_key: "k".into(),
            arguments: args.clone(),
        })),
        AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: "q".into(),
            consumer_tag: "c".into(),
            arguments: args.clone(),
            ..Default::default()
        })),
        AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
            version_major: 0,
            version_minor: 9,
            server_properties: args.clone(),
            mechanisms: "PLAIN".into(),
            locales: "en_US".into(),
        })),
    ];
    for m in methods {
        let name = format!("{m:?}").chars().take(40).collect::<String>();
        let mut h = Harness::with_channel(1);
        h.send(&method(1, m));
        assert!(
            !h.events()
                .iter()
                .any(|e| matches!(e, Event::Command { .. })),
            "{name}: no command for a refused method"
        );
        expect_502(&mut h, &name);
    }
}

#[test]
fn the_deepest_accepted_arguments_reach_the_broker() {
    let mut h = Harness::with_channel(1);
    h.send(&method(
        1,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "q".into(),
            arguments: deep_value(MAX_FIELD_DEPTH),
            ..Default::default()
        })),
    ));
    let events = h.events();
    assert!(
        matches!(events.as_slice(), [Event::Command { channel: 1, .. }]),
        "{events:?}"
    );
}

#[test]
fn deep_arguments_after_login_are_502_not_a_crash() {
    let mut h = Harness::with_channel(1);
    h.send(&declare_with(&nested(&[true; 3000])));
    expect_502(&mut h, "queue.declare 3,000 deep");
}

#[test]
fn deep_message_headers_are_502_not_a_crash() {
    let mut h = Harness::with_channel(1);
    h.send(&publish(1, "", "q"));
    h.send(&header_with(&nested(&[true; 1300])));
    expect_502(&mut h, "headers 1,300 deep");
    let mut h = Harness::with_channel(1);
    h.send(&publish(1, "", "q"));
    let mut props = BasicProperties::default();
    props = props.with_headers(deep_value(MAX_FIELD_DEPTH));
    h.send(&header(1, 0, props));
    assert!(
        h.events()
            .iter()
            .any(|e| matches!(e, Event::Command { .. })),
        "headers at the limit are accepted"
    );
}

#[test]
fn stored_properties_are_decoded_within_the_bound() {
    let mut raw = (1u16 << 13).to_be_bytes().to_vec();
    raw.extend_from_slice(&nested(&[true; 5000]));
    assert!(warren_amqp::decode_properties(&raw).is_none());
    let mut raw = (1u16 << 13).to_be_bytes().to_vec();
    raw.extend_from_slice(&nested(&[true; MAX_FIELD_DEPTH - 1]));
    assert!(warren_amqp::decode_properties(&raw).is_some());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Any mix of tables and arrays, of any depth, in arguments or headers:
    /// accepted up to the bound, 502 beyond it, never a crash.
    #[test]
    fn nested_values_of_any_depth(
        kinds in prop::collection::vec(any::<bool>(), 0..6000),
        in_headers in any::<bool>(),
        truncate in prop::option::of(0usize..64),
    ) {
        let mut bytes = nested(&kinds);
        if let Some(cut) = truncate {
            bytes.truncate(bytes.len().saturating_sub(cut));
        }
        let mut h = Harness::with_channel(1);
        if in_headers {
            h.send(&publish(1, "", "q"));
            h.send(&header_with(&bytes));
        } else {
            h.send(&declare_with(&bytes));
        }
        let frames = h.frames();
        let events = h.events();
        let closed = frames.iter().find_map(|f| match f {
            AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(c))) => {
                Some(c.reply_code)
            }
            _ => None,
        });
        if kinds.len() + 1 > MAX_FIELD_DEPTH && truncate.is_none() {
            prop_assert_eq!(closed, Some(502));
        }
        if truncate.is_none() && kinds.len() < MAX_FIELD_DEPTH {
            prop_assert_eq!(closed, None);
            let command = events.iter().any(|e| matches!(e, Event::Command { .. }));
            prop_assert!(command, "no command: {:?}", events);
        }
    }

    /// The fuzz entry point with structured hostile input: frames carrying
    /// nested values of any depth, oversized lengths, cut anywhere.
    #[test]
    fn the_fuzz_entry_point_survives_nested_and_oversized_frames(
        kinds in prop::collection::vec(any::<bool>(), 0..4000),
        where_ in 0u8..3,
        cut in 0usize..40,
        length in prop::option::of(any::<u32>()),
    ) {
        let mut table = nested(&kinds);
        if let Some(len) = length {
            // Claim any length for the outer table.
            table[..4].copy_from_slice(&len.to_be_bytes());
        }
        let mut frame = match where_ {
            0 => declare_with(&table),
            1 => {
                let mut f = publish(1, "", "q");
                f.extend_from_slice(&header_with(&table));
                f
            }
            _ => {
                let mut props = (1u16 << 13).to_be_bytes().to_vec();
                props.extend_from_slice(&table);
                props
            }
        };
        frame.truncate(frame.len().saturating_sub(cut));
        warren_amqp::fuzz::exercise(&frame);
    }
}

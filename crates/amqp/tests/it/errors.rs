//! Every error code the state machine raises, with RabbitMQ's texts.

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{AMQPClass, basic, channel, confirm, connection, tx};
use warren_amqp::{AmqpError, CloseReason, Command, Config, Event, Reply, ReplyCode};

use crate::{Harness, body, channel_open, header, method, publish};

fn closed_with(h: &mut Harness, code: ReplyCode) {
    let ev = h.events();
    assert!(
        matches!(ev.last(), Some(Event::Closed(CloseReason::ServerClosed(e))) if e.code == code),
        "{ev:?}"
    );
    assert!(h.conn.is_closed());
}

#[test]
fn frame_larger_than_frame_max_is_501() {
    let mut h = Harness::open_with(Config::default(), 4096, 0);
    h.send(&body(1, &[0u8; 5000]));
    h.expect_connection_close(
        501,
        "FRAME_ERROR - frame size 5008 exceeds negotiated frame_max 4096",
    );
    // As RabbitMQ: nothing more is read, and the socket closes 3 s later.
    assert_eq!(h.expect_refused().code, ReplyCode::FrameError);
}

/// RabbitMQ 3.10 takes a payload of up to frame_max bytes (a client that
/// leaves out the frame's own 8 bytes passes) and refuses one more.
#[test]
fn a_payload_of_frame_max_bytes_passes_and_one_more_does_not() {
    let mut h = Harness::open_with(Config::default(), 4096, 0);
    h.send(&channel_open(1));
    h.events();
    h.output();
    h.send(&publish(1, "", "q"));
    h.send(&header(1, 4096, Default::default()));
    h.send(&body(1, &[7u8; 4096]));
    assert!(h.output().is_empty(), "no close");
    assert!(h.conn.is_open());
    h.send(&body(1, &[0u8; 4097]));
    h.expect_connection_close(
        501,
        "FRAME_ERROR - frame size 4105 exceeds negotiated frame_max 4096",
    );
}

#[test]
fn oversized_frame_is_refused_from_its_header_alone() {
    let mut h = Harness::open_with(Config::default(), 4096, 0);
    // Only the 7-byte header of a 1 GiB frame: refused without buffering it.
    h.send(&[3, 0, 1, 0x40, 0, 0, 0]);
    h.expect_connection_close(
        501,
        "FRAME_ERROR - frame size 1073741832 exceeds negotiated frame_max 4096",
    );
}

#[test]
fn bad_frame_end_and_unknown_type_are_501() {
    let mut h = Harness::with_channel(1);
    let mut f = channel_open(2);
    *f.last_mut().unwrap() = 0;
    h.send(&f);
    h.expect_connection_close(
        501,
        "FRAME_ERROR - type 1, channel 2: invalid frame end marker 0x00",
    );
    // As RabbitMQ: nothing more is read, and the socket closes 3 s later.
    assert_eq!(h.expect_refused().code, ReplyCode::FrameError);

    let mut h = Harness::with_channel(1);
    h.send(&[7, 0, 0, 0, 0, 0, 0, 0xCE]);
    h.expect_connection_close(501, "FRAME_ERROR - unknown frame type 7");
}

#[test]
fn undecodable_method_is_501() {
    let mut h = Harness::with_channel(1);
    // queue.declare whose short string runs past the payload: RabbitMQ
    // 3.10 answers 501 FRAME_ERROR "cannot decode".
    h.send(&[1, 0, 1, 0, 0, 0, 8, 0, 50, 0, 10, 0, 0, 200, 1, 0xCE]);
    h.expect_connection_close(501, "FRAME_ERROR - cannot decode method 50.10");
}

#[test]
fn unknown_method_is_540() {
    let mut h = Harness::with_channel(1);
    h.send(&[1, 0, 1, 0, 0, 0, 4, 0, 50, 0, 99, 0xCE]);
    h.expect_connection_close(540, "NOT_IMPLEMENTED - unknown method class 50 method 99");
}

#[test]
fn immediate_and_prefetch_size_and_flow_off_are_540() {
    let mut h = Harness::with_channel(1);
    h.send(&method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: "q".into(),
            mandatory: false,
            immediate: true,
        })),
    ));
    h.expect_connection_close(540, "NOT_IMPLEMENTED - immediate=true");

    let mut h = Harness::with_channel(1);
    // basic.qos prefetch_size=1024 (amq-protocol cannot generate it).
    h.send(&[
        1, 0, 1, 0, 0, 0, 11, 0, 60, 0, 10, 0, 0, 4, 0, 0, 10, 0, 0xCE,
    ]);
    h.expect_connection_close(540, "NOT_IMPLEMENTED - prefetch_size!=0 (1024)");

    let mut h = Harness::with_channel(1);
    h.send(&method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Flow(channel::Flow { active: false })),
    ));
    h.expect_connection_close(540, "NOT_IMPLEMENTED - active=false");
}

#[test]
fn method_on_closed_channel_is_504() {
    let mut h = Harness::with_channel(1);
    h.send(&publish(3, "", "q"));
    h.expect_connection_close(504, "CHANNEL_ERROR - expected 'channel.open'");
}

#[test]
fn second_channel_open_is_504() {
    let mut h = Harness::with_channel(1);
    h.send(&channel_open(1));
    h.expect_connection_close(504, "CHANNEL_ERROR - second 'channel.open' seen");
}

/// RabbitMQ (3.10 and current) counts the open channels against
/// channel_max; any channel number up to 65535 may be opened (aiormq's suite
/// opens 65535 under channel_max 2047). A closed channel frees its place.
#[test]
fn channels_beyond_channel_max_open_are_530() {
    let config = Config {
        channel_max: 2,
        ..Config::default()
    };
    let mut h = Harness::open_with(config, 131_072, 0);
    h.send(&channel_open(65535));
    h.send(&channel_open(3));
    assert_eq!(
        h.events(),
        vec![Event::ChannelOpened(65535), Event::ChannelOpened(3)]
    );
    h.output();
    h.send(&crate::channel_close(3));
    h.send(&channel_open(7));
    assert!(
        h.events().contains(&Event::ChannelOpened(7)),
        "3's place is free again"
    );
    h.output();
    h.send(&channel_open(1));
    h.expect_connection_close(
        530,
        "NOT_ALLOWED - number of channels opened (2) has reached the negotiated channel_max (2)",
    );
}

#[test]
fn server_only_method_from_client_is_503() {
    let mut h = Harness::with_channel(1);
    h.send(&method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})),
    ));
    h.expect_connection_close(503, "COMMAND_INVALID - unimplemented method");

    let mut h = Harness::with_channel(1);
    // RabbitMQ 3.10: 505 for a heartbeat on a channel other than 0.
    h.send(&[8, 0, 1, 0, 0, 0, 0, 0xCE]);
    h.expect_connection_close(505, "UNEXPECTED_FRAME - heartbeat frame on channel 1");

    let mut h = Harness::with_channel(1);
    h.send(&method(
        1,
        AMQPClass::Connection(connection::AMQPMethod::Blocked(connection::Blocked {
            reason: "x".into(),
        })),
    ));
    h.expect_connection_close(
        503,
        "COMMAND_INVALID - connection methods must be sent on channel 0",
    );
}

#[test]
fn content_out_of_order_is_505() {
    // A header without a publish.
    let mut h = Harness::with_channel(1);
    h.send(&header(1, 3, Default::default()));
    h.expect_connection_close(
        505,
        "UNEXPECTED_FRAME - expected method frame, got non method frame instead",
    );
    // A method where the header should be.
    let mut h = Harness::with_channel(1);
    h.send(&publish(1, "", "q"));
    h.send(&publish(1, "", "q"));
    h.expect_connection_close(
        505,
        "UNEXPECTED_FRAME - expected content header for class 60, got non content header frame instead",
    );
    // A method where the body should be.
    let mut h = Harness::with_channel(1);
    h.send(&publish(1, "", "q"));
    h.send(&header(1, 3, Default::default()));
    h.send(&publish(1, "", "q"));
    h.expect_connection_close(
        505,
        "UNEXPECTED_FRAME - expected content body, got non content body frame instead",
    );
    // A body where the header should be.
    let mut h = Harness::with_channel(1);
    h.send(&publish(1, "", "q"));
    h.send(&body(1, b"abc"));
    h.expect_connection_close(
        505,
        "UNEXPECTED_FRAME - expected content header for class 60, got non content header frame instead",
    );
    // More body than the header declared.
    let mut h = Harness::with_channel(1);
    h.send(&publish(1, "", "q"));
    h.send(&header(1, 2, Default::default()));
    h.send(&body(1, b"abc"));
    h.expect_connection_close(
        505,
        "UNEXPECTED_FRAME - content body frame of 3 bytes exceeds the 2 bytes left of the declared body size",
    );
    // Content on channel 0.
    let mut h = Harness::with_channel(1);
    h.send(&body(0, b"abc"));
    h.expect_connection_close(
        505,
        "UNEXPECTED_FRAME - content frame on channel 0 in connection state running",
    );
}

#[test]
fn oversized_message_is_406_channel_close_then_ignored() {
    let config = Config {
        message_size_max: 10,
        ..Config::default()
    };
    let mut h = Harness::open_with(config, 131_072, 0);
    h.send(&channel_open(1));
    h.events();
    h.output();
    h.send(&publish(1, "", "q"));
    h.send(&header(1, 11, Default::default()));
    h.expect_channel_close(
        1,
        406,
        "PRECONDITION_FAILED - message size 11 is larger than configured max size 10",
    );
    let ev = h.events();
    assert!(
        matches!(&ev[..], [Event::ChannelClosed { channel: 1, error: Some(e) }] if e.code == ReplyCode::PreconditionFailed),
        "{ev:?}"
    );
    // The body that follows and further methods are dropped until close-ok.
    h.send(&body(1, b"01234567890"));
    h.send(&publish(1, "", "q"));
    assert!(h.output().is_empty());
    assert!(h.events().is_empty());
    assert!(!h.conn.reply(1, Reply::BasicQosOk));
    h.send(&method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    ));
    h.send(&channel_open(1));
    assert_eq!(h.events(), vec![Event::ChannelOpened(1)]);
}

#[test]
fn unfinished_messages_over_the_connection_limit_are_506() {
    let config = Config {
        partial_content_max: 100,
        ..Config::default()
    };
    let mut h = Harness::open_with(config, 131_072, 0);
    for ch in [1, 2, 3] {
        h.send(&channel_open(ch));
    }
    h.events();
    h.output();
    assert!(!h.conn.has_published());
    // A finished message frees its share: 3 x 60 bytes pass one at a time.
    for _ in 0..3 {
        h.send(&publish(1, "", "q"));
        assert!(h.conn.has_published(), "a publish counts from its method");
        h.send(&header(1, 61, Default::default()));
        h.send(&body(1, &[7; 60]));
        h.send(&body(1, &[7; 1]));
    }
    assert!(h.output().is_empty());
    // Two unfinished ones of 60 bytes each exceed 100 together.
    for ch in [2, 3] {
        h.send(&publish(ch, "", "q"));
        h.send(&header(ch, 1000, Default::default()));
        h.send(&body(ch, &[7; 60]));
    }
    h.expect_connection_close(
        506,
        "RESOURCE_ERROR - unfinished messages on this connection exceed 100 bytes",
    );
}

#[test]
fn broker_channel_errors_close_the_channel_with_rabbitmq_text() {
    let mut h = Harness::with_channel(1);
    h.conn.channel_error(
        1,
        AmqpError::queue_not_found("missing", "/").with_method(50, 10),
    );
    match h.one_method() {
        (1, AMQPClass::Channel(channel::AMQPMethod::Close(c))) => {
            assert_eq!(c.reply_code, 404);
            assert_eq!(
                c.reply_text.as_str(),
                "NOT_FOUND - no queue 'missing' in vhost '/'"
            );
            assert_eq!((c.class_id, c.method_id), (50, 10));
        }
        other => panic!("{other:?}"),
    }
    for code in [
        ReplyCode::AccessRefused,
        ReplyCode::ResourceLocked,
        ReplyCode::PreconditionFailed,
    ] {
        let mut h = Harness::with_channel(1);
        h.conn.channel_error(1, AmqpError::new(code, "x"));
        h.expect_channel_close(1, code.code(), &format!("{} - x", code.name()));
    }
    // A hard code given for a channel closes the connection.
    let mut h = Harness::with_channel(1);
    h.conn
        .channel_error(1, AmqpError::new(ReplyCode::NotAllowed, "nope"));
    h.expect_connection_close(530, "NOT_ALLOWED - nope");
}

#[test]
fn both_sides_closing_a_channel_at_once() {
    let mut h = Harness::with_channel(1);
    h.conn
        .channel_error(1, AmqpError::new(ReplyCode::NotFound, "x"));
    h.output();
    h.send(&crate::channel_close(1));
    assert!(matches!(
        h.one_method(),
        (1, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)))
    ));
    assert!(!h.conn.is_channel_open(1));
}

#[test]
fn tx_and_confirm_modes_exclude_each_other() {
    let mut h = Harness::with_channel(1);
    h.send(&method(
        1,
        AMQPClass::Tx(tx::AMQPMethod::Select(tx::Select {})),
    ));
    assert!(matches!(
        h.events().as_slice(),
        [Event::Command {
            channel: 1,
            command: Command::TxSelect
        }]
    ));
    h.send(&method(
        1,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
    ));
    h.expect_channel_close(
        1,
        406,
        "PRECONDITION_FAILED - cannot switch from tx to confirm mode",
    );

    let mut h = Harness::with_channel(1);
    h.send(&method(
        1,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
    ));
    h.events();
    h.send(&method(
        1,
        AMQPClass::Tx(tx::AMQPMethod::Select(tx::Select {})),
    ));
    h.expect_channel_close(
        1,
        406,
        "PRECONDITION_FAILED - cannot switch from confirm to tx mode",
    );

    let mut h = Harness::with_channel(1);
    h.send(&method(
        1,
        AMQPClass::Tx(tx::AMQPMethod::Commit(tx::Commit {})),
    ));
    h.expect_channel_close(1, 406, "PRECONDITION_FAILED - channel is not transactional");
}

#[test]
fn close_timeout_ends_connection() {
    let mut h = Harness::with_channel(1);
    h.conn.handle_tick(0);
    h.conn
        .connection_error(AmqpError::new(ReplyCode::InternalError, "boom"));
    h.output();
    h.conn.handle_tick(1000);
    assert!(!h.conn.is_closed());
    h.conn
        .handle_tick(1000 + Config::default().close_timeout_ms);
    closed_with(&mut h, ReplyCode::InternalError);
}

#[test]
fn reply_codes_round_trip_and_know_their_kind() {
    for code in [
        200u16, 311, 312, 313, 320, 402, 403, 404, 405, 406, 501, 502, 503, 504, 505, 506, 530,
        540, 541,
    ] {
        let rc = ReplyCode::from_code(code).expect("defined");
        assert_eq!(rc.code(), code);
        assert_eq!(
            rc.is_hard(),
            code == 320 || code == 402 || code >= 500,
            "{rc}"
        );
    }
    assert_eq!(ReplyCode::from_code(999), None);
    let e = AmqpError::exchange_not_found("x", "/");
    assert_eq!(e.to_string(), "NOT_FOUND - no exchange 'x' in vhost '/'");
    let long = AmqpError::new(ReplyCode::NotFound, "é".repeat(300));
    assert!(long.reply_text().len() <= 255);
    assert!(long.reply_text().ends_with("é..."));
}

/// Methods pipelined in one read, the second refused while reading: the
/// broker still takes (and answers) the first, and channel.close follows
/// its reply, as RabbitMQ's channel answers them in turn. The close used
/// to go out while the first waited, and its reply was then dropped.
#[test]
fn a_read_fault_waits_behind_the_methods_read_before_it() {
    let mut h = Harness::with_channel(1);
    let mut both = method(1, AMQPClass::Tx(tx::AMQPMethod::Select(tx::Select {})));
    both.extend(method(
        1,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
    ));
    // and a third, after the fault: not taken
    both.extend(method(
        1,
        AMQPClass::Tx(tx::AMQPMethod::Commit(tx::Commit {})),
    ));
    h.send(&both);
    assert!(
        h.output().is_empty(),
        "nothing before the first is answered"
    );
    assert_eq!(
        h.conn.poll_event(),
        Some(Event::Command {
            channel: 1,
            command: Command::TxSelect
        })
    );
    assert!(h.conn.reply(1, Reply::TxSelectOk), "its reply goes out");
    let rest = h.events();
    assert!(
        matches!(rest.as_slice(), [Event::ChannelClosed { channel: 1, .. }]),
        "{rest:?}"
    );
    let frames = h.frames();
    assert!(
        matches!(
            frames.as_slice(),
            [
                AMQPFrame::Method(1, AMQPClass::Tx(tx::AMQPMethod::SelectOk(_))),
                AMQPFrame::Method(1, AMQPClass::Channel(channel::AMQPMethod::Close(c))),
            ] if c.reply_code == 406
        ),
        "{frames:?}"
    );
}

/// A content header whose weight is not 0 (the spec's weight is always 0):
/// RabbitMQ 3.10 closes the connection with 505, naming basic.publish
/// (recorded by the hostile-input sweep, docs/faults.md).
#[test]
fn a_content_header_with_a_weight_is_505() {
    let mut h = Harness::with_channel(1);
    h.send(&publish(1, "", "q"));
    let mut hdr = header(1, 1, Default::default());
    // type, channel, size, then class id (2 bytes): the weight's low byte.
    hdr[7 + 3] = 1;
    h.send(&hdr);
    h.expect_connection_close_naming(505, 60, 40);
}

/// A channel.close-ok with no channel.close of ours to answer: RabbitMQ
/// 3.10 closes the connection with 503 naming channel.close-ok (recorded by
/// the hostile-input sweep, docs/faults.md); it was ignored.
#[test]
fn an_unasked_channel_close_ok_is_503() {
    let mut h = Harness::with_channel(1);
    h.send(&method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    ));
    h.expect_connection_close_naming(503, 20, 41);
}

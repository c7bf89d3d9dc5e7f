//! Protocol header, start/start-ok, tune/tune-ok, open, close, channels.

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{AMQPClass, channel, connection};
use amq_protocol::types::AMQPValue;
use warren_amqp::{AmqpError, CloseReason, Config, Credentials, Event, Mechanism, ReplyCode};

use crate::{Harness, channel_open, method, open, start_ok, tune_ok};

#[test]
fn full_handshake_advertises_rabbitmq_capabilities() {
    let mut h = Harness::new(Config::default());
    h.send(b"AMQP\x00\x00\x09\x01");
    let (ch, m) = h.one_method();
    assert_eq!(ch, 0);
    let AMQPClass::Connection(connection::AMQPMethod::Start(start)) = m else {
        panic!("expected start, got {m:?}");
    };
    assert_eq!((start.version_major, start.version_minor), (0, 9));
    assert_eq!(start.mechanisms.to_string(), "PLAIN AMQPLAIN");
    assert_eq!(start.locales.to_string(), "en_US");
    let props = start.server_properties.inner();
    for k in ["product", "version", "platform", "copyright", "information"] {
        assert!(
            matches!(props.get(k), Some(AMQPValue::LongString(_))),
            "{k}"
        );
    }
    let Some(AMQPValue::FieldTable(caps)) = props.get("capabilities") else {
        panic!("no capabilities");
    };
    for k in [
        "publisher_confirms",
        "exchange_exchange_bindings",
        "basic.nack",
        "consumer_cancel_notify",
        "connection.blocked",
        "authentication_failure_close",
        "per_consumer_qos",
        "consumer_priorities",
        "direct_reply_to",
    ] {
        assert_eq!(caps.inner().get(k), Some(&AMQPValue::Boolean(true)), "{k}");
    }

    h.send(&start_ok("alice", "s3cret", true));
    assert!(h.frames().is_empty());
    assert_eq!(
        h.events(),
        vec![Event::Authenticate(Credentials {
            mechanism: Mechanism::Plain,
            username: "alice".into(),
            password: "s3cret".into(),
        })]
    );
    h.conn.accept_login();
    let (_, m) = h.one_method();
    assert_eq!(
        m,
        AMQPClass::Connection(connection::AMQPMethod::Tune(connection::Tune {
            channel_max: 2047,
            frame_max: 131_072,
            heartbeat: 60,
        }))
    );
    h.send(&tune_ok(100, 65_536, 30));
    assert_eq!(h.conn.frame_max(), 65_536);
    assert_eq!(h.conn.channel_max(), 100);
    assert_eq!(h.conn.heartbeat_secs(), 30);
    h.send(&open("prod"));
    assert_eq!(
        h.events(),
        vec![Event::OpenVhost {
            vhost: "prod".into()
        }]
    );
    assert!(!h.conn.is_open());
    h.conn.accept_vhost();
    let (_, m) = h.one_method();
    assert!(matches!(
        m,
        AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))
    ));
    assert!(h.conn.is_open());
    assert_eq!(h.conn.username(), "alice");
    assert_eq!(h.conn.vhost(), "prod");
}

#[test]
fn header_and_start_ok_in_one_read_pauses_until_login_answered() {
    let mut h = Harness::new(Config::default());
    let mut bytes = b"AMQP\x00\x00\x09\x01".to_vec();
    bytes.extend(start_ok("u", "p", true));
    bytes.extend(tune_ok(2047, 131_072, 0));
    bytes.extend(open("/"));
    h.send(&bytes);
    assert!(matches!(h.events().as_slice(), [Event::Authenticate(_)]));
    assert!(h.pending_input() > 0, "input pauses while login is pending");
    h.conn.accept_login();
    h.resume();
    assert!(matches!(h.events().as_slice(), [Event::OpenVhost { .. }]));
    h.conn.accept_vhost();
    let frames = h.frames();
    assert_eq!(
        frames.len(),
        3,
        "start, tune, open-ok in one output: {frames:?}"
    );
    assert!(h.conn.is_open());
}

#[test]
fn wrong_protocol_header_gets_ours_and_close() {
    for bad in [
        &b"AMQP\x00\x00\x09\x00"[..],
        b"AMQP\x01\x01\x00\x0a",
        b"GET / HTTP/1.1\r\n",
    ] {
        let mut h = Harness::new(Config::default());
        h.send(bad);
        assert_eq!(&h.output()[..], b"AMQP\x00\x00\x09\x01");
        assert_eq!(
            h.events(),
            vec![Event::Closed(CloseReason::BadProtocolHeader)]
        );
        assert!(h.conn.is_closed());
    }
}

#[test]
fn partial_protocol_header_waits() {
    let mut h = Harness::new(Config::default());
    h.send(b"AMQ");
    assert!(h.output().is_empty());
    h.send(b"P\x00\x00\x09\x01");
    assert_eq!(h.frames().len(), 1);
}

#[test]
fn amqplain_login() {
    let mut h = Harness::new(Config::default());
    h.send(b"AMQP\x00\x00\x09\x01");
    let creds = amq_protocol::auth::Credentials::new("bob".into(), "pw".into());
    let response = creds.sasl_auth_string(amq_protocol::auth::SASLMechanism::AMQPlain);
    h.send(&crate::start_ok_raw("AMQPLAIN", response));
    h.output();
    assert_eq!(
        h.events(),
        vec![Event::Authenticate(Credentials {
            mechanism: Mechanism::AmqPlain,
            username: "bob".into(),
            password: "pw".into(),
        })]
    );
}

#[test]
fn refused_login_closes_with_403_when_client_can_take_it() {
    // RabbitMQ 3.10: connection.close 403, then the socket closes 3 s later
    // whether or not close-ok came.
    let mut h = Harness::new(Config::default());
    h.send(b"AMQP\x00\x00\x09\x01");
    h.send(&start_ok("u", "wrong", true));
    h.output();
    h.events();
    h.conn.refuse_login();
    h.expect_connection_close(
        403,
        "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN. For details see the broker logfile.",
    );
    assert_eq!(h.expect_refused().code, ReplyCode::AccessRefused);
}

#[test]
fn refused_login_drops_socket_without_capability() {
    let mut h = Harness::new(Config::default());
    h.send(b"AMQP\x00\x00\x09\x01");
    h.send(&start_ok("u", "wrong", false));
    h.output();
    h.events();
    h.conn.refuse_login();
    assert!(h.output().is_empty());
    assert_eq!(h.expect_refused().code, ReplyCode::AccessRefused);
}

#[test]
fn malformed_plain_response_is_refused_without_event() {
    let mut h = Harness::new(Config::default());
    h.send(b"AMQP\x00\x00\x09\x01");
    h.output();
    h.send(&crate::start_ok_raw("PLAIN", "no-nul-here".into()));
    assert!(h.output().is_empty());
    h.expect_refused();
}

#[test]
fn unknown_mechanism_is_refused_silently() {
    // RabbitMQ 3.10 answers no connection.close before tune-ok: the socket
    // closes 3 s later.
    let mut h = Harness::new(Config::default());
    h.send(b"AMQP\x00\x00\x09\x01");
    h.output();
    h.send(&crate::start_ok_raw("EXTERNAL", "".into()));
    let e = h.expect_refused();
    assert_eq!(e.code, ReplyCode::CommandInvalid);
    assert_eq!(e.text, "unknown authentication mechanism 'EXTERNAL'");
}

fn tune_ok_result(channel_max: u16, frame_max: u32) -> Harness {
    let mut h = Harness::new(Config::default());
    h.send(b"AMQP\x00\x00\x09\x01");
    h.send(&start_ok("u", "p", true));
    h.events();
    h.conn.accept_login();
    h.output();
    h.send(&tune_ok(channel_max, frame_max, 0));
    h
}

#[test]
fn tune_ok_negotiation_follows_rabbitmq() {
    // Refused as RabbitMQ 3.10 refuses: no connection.close while tuning,
    // the socket closed 3 s later.
    for (channel_max, frame_max, text) in [
        (
            10,
            1024,
            "negotiated frame_max = 1024 is lower than the minimum allowed value (4096)",
        ),
        (
            10,
            200_000,
            "negotiated frame_max = 200000 is higher than the maximum allowed value (131072)",
        ),
        (
            10,
            0,
            "negotiated frame_max = 0 (no limit) is higher than the maximum allowed value (131072)",
        ),
        (
            0,
            4096,
            "negotiated channel_max = 0 (no limit) is higher than the maximum allowed value (2047)",
        ),
    ] {
        let mut h = tune_ok_result(channel_max, frame_max);
        assert!(h.output().is_empty());
        let e = h.expect_refused();
        assert_eq!((e.code, e.text.as_str()), (ReplyCode::NotAllowed, text));
    }
    let mut h = tune_ok_result(2047, 4096);
    assert!(h.output().is_empty());
    assert_eq!(h.conn.frame_max(), 4096);
}

#[test]
fn unlimited_server_accepts_zero() {
    let config = Config {
        frame_max: 0,
        channel_max: 0,
        ..Config::default()
    };
    let h = Harness::open_with(config, 0, 0);
    assert_eq!(h.conn.frame_max(), 0);
    assert_eq!(h.conn.channel_max(), u16::MAX);
}

#[test]
fn refused_vhost_is_not_allowed() {
    let mut h = tune_ok_result(2047, 131_072);
    h.send(&open("nope"));
    h.events();
    h.conn.refuse_vhost(AmqpError::vhost_not_found("nope"));
    h.expect_connection_close(530, "NOT_ALLOWED - vhost nope not found");
}

#[test]
fn method_out_of_handshake_order_is_refused_silently() {
    let mut h = Harness::new(Config::default());
    h.send(b"AMQP\x00\x00\x09\x01");
    h.output();
    h.send(&open("/"));
    let e = h.expect_refused();
    assert_eq!(e.code, ReplyCode::ChannelError);
    assert_eq!(e.text, "unexpected method in connection state starting");
}

#[test]
fn a_channel_method_while_opening_is_unexpected_frame() {
    // After tune-ok, before connection.open: RabbitMQ 3.10 closes with 505.
    let mut h = tune_ok_result(2047, 131_072);
    h.send(&channel_open(1));
    h.expect_connection_close(
        505,
        "UNEXPECTED_FRAME - unexpected method on channel 1 in connection state opening",
    );
}

#[test]
fn a_channel_method_on_channel_0_is_channel_error() {
    let mut h = Harness::with_channel(1);
    h.send(&channel_open(0));
    h.expect_connection_close(
        504,
        "CHANNEL_ERROR - unexpected method in connection state running",
    );
}

#[test]
fn the_0_9_protocol_header_is_served_as_0_9_1() {
    let mut h = Harness::new(Config::default());
    h.send(b"AMQP\x01\x01\x00\x09");
    assert!(matches!(
        h.one_method(),
        (0, AMQPClass::Connection(connection::AMQPMethod::Start(_)))
    ));
}

#[test]
fn client_close_gets_close_ok_and_closed_event() {
    let mut h = Harness::with_channel(1);
    h.send(&method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    ));
    let (_, m) = h.one_method();
    assert!(matches!(
        m,
        AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))
    ));
    assert_eq!(
        h.events(),
        vec![Event::Closed(CloseReason::ClientClosed {
            reply_code: 200,
            reply_text: "bye".into()
        })]
    );
    assert!(h.conn.is_closed());
    // Anything later is dropped.
    h.send(&channel_open(2));
    assert!(h.output().is_empty());
    assert!(h.events().is_empty());
}

/// After its close-ok, a client's further connection.close gets close-ok
/// again, as RabbitMQ 3.10 answers it (`client_close_twice` in
/// `crates/node/tests/hostile/preopen.py`); everything else is skipped frame
/// by frame, a large one across several reads.
#[test]
fn a_repeated_client_close_gets_close_ok_again() {
    let close = method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    );
    let close_ok = |h: &mut Harness| {
        let frames = h.frames();
        assert_eq!(frames.len(), 1, "{frames:?}");
        assert!(matches!(
            &frames[0],
            AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)))
        ));
    };
    let mut h = Harness::with_channel(1);
    h.send(&[close.clone(), close.clone()].concat());
    let frames = h.frames();
    assert_eq!(frames.len(), 2, "one close-ok per close: {frames:?}");
    assert_eq!(h.events().len(), 1, "one Closed event");
    // A body frame of 100,000 bytes whose payload looks like a close, sent
    // in pieces, then a close split in two.
    let mut big = vec![3, 0, 1];
    big.extend_from_slice(&100_000u32.to_be_bytes());
    big.extend(close.iter().cycle().take(100_000));
    big.push(0xCE);
    for piece in big.chunks(7_000) {
        h.send(piece);
        assert!(h.output().is_empty());
    }
    h.send(&close[..9]);
    assert!(h.output().is_empty());
    h.send(&close[9..]);
    close_ok(&mut h);
    assert_eq!(h.pending_input(), 0);
    assert!(h.events().is_empty());
}

#[test]
fn server_close_ignores_all_but_close_ok() {
    let mut h = Harness::with_channel(1);
    h.conn.connection_error(AmqpError::new(
        ReplyCode::ConnectionForced,
        "broker forced connection closure with reason 'shutdown'",
    ));
    h.expect_connection_close(
        320,
        "CONNECTION_FORCED - broker forced connection closure with reason 'shutdown'",
    );
    h.send(&crate::publish(1, "", "q"));
    h.send(&channel_open(2));
    h.send(&[8, 0, 0, 0, 0, 0, 0, 0xCE]);
    assert!(h.output().is_empty());
    assert!(h.events().is_empty());
    assert!(!h.conn.reply(1, warren_amqp::Reply::BasicQosOk));
    h.send(&method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
    ));
    assert!(matches!(
        h.events().as_slice(),
        [Event::Closed(CloseReason::ServerClosed(e))] if e.code == ReplyCode::ConnectionForced
    ));
}

#[test]
fn channel_open_close_flow() {
    let mut h = Harness::with_channel(1);
    h.send(&channel_open(2));
    assert_eq!(h.events(), vec![Event::ChannelOpened(2)]);
    assert!(matches!(
        h.one_method(),
        (2, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)))
    ));
    h.send(&method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Flow(channel::Flow { active: true })),
    ));
    assert_eq!(
        h.one_method(),
        (
            1,
            AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk {
                active: true
            }))
        )
    );
    h.send(&crate::channel_close(1));
    assert!(matches!(
        h.one_method(),
        (1, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)))
    ));
    assert_eq!(
        h.events(),
        vec![Event::ChannelClosed {
            channel: 1,
            error: None
        }]
    );
    assert!(!h.conn.is_channel_open(1));
    assert!(h.conn.is_channel_open(2));
    // Reopening the same number works.
    h.send(&channel_open(1));
    assert_eq!(h.events(), vec![Event::ChannelOpened(1)]);
}

#[test]
fn many_frames_in_one_read_give_one_output() {
    let mut h = Harness::open_with(Config::default(), 131_072, 0);
    let mut bytes = Vec::new();
    for ch in 1..=50 {
        bytes.extend(channel_open(ch));
    }
    h.send(&bytes);
    assert_eq!(h.events().len(), 50);
    let frames = h.frames();
    assert_eq!(frames.len(), 50);
    assert!(frames.iter().all(|f| matches!(
        f,
        AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)))
    )));
}

#[test]
fn update_secret_is_answered_with_update_secret_ok() {
    let mut h = Harness::with_channel(1);
    h.send(&method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::UpdateSecret(
            connection::UpdateSecret {
                new_secret: "new".into(),
                reason: "token refresh".into(),
            },
        )),
    ));
    match h.one_method() {
        (0, AMQPClass::Connection(connection::AMQPMethod::UpdateSecretOk(_))) => {}
        other => panic!("expected update-secret-ok, got {other:?}"),
    }
    assert!(h.conn.is_open());
}

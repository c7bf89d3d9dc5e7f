//! Drives `warren_amqp::Connection` with frames made by amq-protocol's
//! generators (acting as the client) and decodes its output with
//! amq-protocol's parser.

mod content;
mod errors;
mod fuzz;
mod handshake;
mod heartbeat;
mod nesting;

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, WriteContext, gen_frame, parse_frame};
use amq_protocol::protocol::{AMQPClass, BasicProperties, basic, channel, connection};
use amq_protocol::types::{AMQPValue, FieldTable};
use bytes::BytesMut;
use warren_amqp::{CloseReason, Config, Connection, Event};

/// Encodes one frame as a client would.
pub fn frame(f: &AMQPFrame) -> Vec<u8> {
    gen_frame(f)(WriteContext::from(Vec::new()))
        .expect("encode")
        .into_inner()
        .0
}

/// Encodes one method frame.
pub fn method(ch: u16, class: AMQPClass) -> Vec<u8> {
    frame(&AMQPFrame::Method(ch, class))
}

/// Encodes a content header frame.
pub fn header(ch: u16, body_size: u64, properties: BasicProperties) -> Vec<u8> {
    frame(&AMQPFrame::Header(
        ch,
        AMQPContentHeader {
            class_id: 60,
            body_size,
            properties,
        },
    ))
}

/// Encodes a body frame.
pub fn body(ch: u16, data: &[u8]) -> Vec<u8> {
    frame(&AMQPFrame::Body(ch, data.to_vec()))
}

/// A basic.publish method frame.
pub fn publish(ch: u16, exchange: &str, key: &str) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: exchange.into(),
            routing_key: key.into(),
            mandatory: false,
            immediate: false,
        })),
    )
}

/// The client's start-ok with PLAIN credentials and the usual capabilities.
pub fn start_ok(user: &str, pass: &str, caps: bool) -> Vec<u8> {
    let mut props = FieldTable::default();
    if caps {
        let mut c = FieldTable::default();
        for k in [
            "authentication_failure_close",
            "connection.blocked",
            "consumer_cancel_notify",
            "publisher_confirms",
        ] {
            c.insert(k.into(), AMQPValue::Boolean(true));
        }
        props.insert("capabilities".into(), AMQPValue::FieldTable(c));
    }
    method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: props,
            mechanism: "PLAIN".into(),
            response: format!("\0{user}\0{pass}").into(),
            locale: "en_US".into(),
        })),
    )
}

/// A start-ok with any mechanism and response, and no client properties.
pub fn start_ok_raw(mechanism: &str, response: amq_protocol::types::LongString) -> Vec<u8> {
    method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: FieldTable::default(),
            mechanism: mechanism.into(),
            response,
            locale: "en_US".into(),
        })),
    )
}

/// A client channel.close (200) on `ch`.
pub fn channel_close(ch: u16) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 200,
            reply_text: "".into(),
            class_id: 0,
            method_id: 0,
        })),
    )
}

/// The client's tune-ok.
pub fn tune_ok(channel_max: u16, frame_max: u32, heartbeat: u16) -> Vec<u8> {
    method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max,
            frame_max,
            heartbeat,
        })),
    )
}

/// The client's connection.open.
pub fn open(vhost: &str) -> Vec<u8> {
    method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: vhost.into(),
        })),
    )
}

/// channel.open on `ch`.
pub fn channel_open(ch: u16) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    )
}

/// A connection under test and the client's side of the socket.
#[derive(Debug)]
pub struct Harness {
    /// The state machine.
    pub conn: Connection,
    inbuf: BytesMut,
}

impl Harness {
    /// A fresh connection with `config`.
    pub fn new(config: Config) -> Self {
        Self {
            conn: Connection::new(config),
            inbuf: BytesMut::new(),
        }
    }

    /// Feeds client bytes.
    pub fn send(&mut self, bytes: &[u8]) {
        self.inbuf.extend_from_slice(bytes);
        self.conn.handle_bytes(&mut self.inbuf);
    }

    /// Re-feeds buffered bytes (after answering a pausing event).
    pub fn resume(&mut self) {
        self.conn.handle_bytes(&mut self.inbuf);
    }

    /// Bytes left unconsumed in the input buffer.
    pub fn pending_input(&self) -> usize {
        self.inbuf.len()
    }

    /// Raw output bytes.
    pub fn output(&mut self) -> BytesMut {
        let mut out = BytesMut::new();
        self.conn.take_output(&mut out);
        out
    }

    /// Output decoded into frames.
    pub fn frames(&mut self) -> Vec<AMQPFrame> {
        let out = self.output();
        let mut rest: &[u8] = &out;
        let mut frames = Vec::new();
        while !rest.is_empty() {
            let (r, f) = parse_frame(rest).expect("server output must parse");
            frames.push(f);
            rest = r;
        }
        frames
    }

    /// Every pending event.
    pub fn events(&mut self) -> Vec<Event> {
        std::iter::from_fn(|| self.conn.poll_event()).collect()
    }

    /// The single method frame in the output.
    pub fn one_method(&mut self) -> (u16, AMQPClass) {
        let frames = self.frames();
        assert_eq!(frames.len(), 1, "expected one frame, got {frames:?}");
        match frames.into_iter().next() {
            Some(AMQPFrame::Method(ch, m)) => (ch, m),
            other => panic!("expected a method, got {other:?}"),
        }
    }

    /// Asserts that the connection was refused while starting, as RabbitMQ
    /// refuses one: nothing more is answered or read, and the connection
    /// ends [`Config::silent_close_ms`] after the refusal with the error
    /// it returns.
    pub fn expect_refused(&mut self) -> warren_amqp::AmqpError {
        const T0: u64 = 1_000_000;
        let delay = Config::default().silent_close_ms;
        assert!(self.events().is_empty(), "no event before the delay");
        self.conn.handle_tick(T0);
        self.send(b"\x01\x00\x00 ignored while refusing");
        assert_eq!(self.pending_input(), 0, "input is dropped");
        assert!(self.output().is_empty(), "nothing is answered");
        assert_eq!(self.conn.poll_timeout(), Some(T0 + delay));
        self.conn.handle_tick(T0 + delay - 1);
        assert!(self.events().is_empty(), "no event before the delay");
        assert!(!self.conn.is_closed());
        self.conn.handle_tick(T0 + delay);
        assert!(self.conn.is_closed());
        match self.events().as_slice() {
            [Event::Closed(CloseReason::ServerClosed(e))] => e.clone(),
            other => panic!("expected one Closed event, got {other:?}"),
        }
    }

    /// Asserts the output is one connection.close with `code` and `text`.
    pub fn expect_connection_close(&mut self, code: u16, text: &str) {
        match self.one_method() {
            (0, AMQPClass::Connection(connection::AMQPMethod::Close(c))) => {
                assert_eq!(c.reply_code, code, "{c:?}");
                assert_eq!(c.reply_text.as_str(), text);
            }
            other => panic!("expected connection.close, got {other:?}"),
        }
    }

    /// Asserts the output is one connection.close with `code` naming the
    /// method `class_id`.`method_id`.
    pub fn expect_connection_close_naming(&mut self, code: u16, class_id: u16, method_id: u16) {
        match self.one_method() {
            (0, AMQPClass::Connection(connection::AMQPMethod::Close(c))) => {
                assert_eq!(
                    (c.reply_code, c.class_id, c.method_id),
                    (code, class_id, method_id),
                    "{c:?}"
                );
            }
            other => panic!("expected connection.close, got {other:?}"),
        }
    }

    /// Asserts the output is one channel.close on `ch` with `code` and `text`.
    pub fn expect_channel_close(&mut self, ch: u16, code: u16, text: &str) {
        match self.one_method() {
            (c, AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
                assert_eq!(c, ch);
                assert_eq!(close.reply_code, code, "{close:?}");
                assert_eq!(close.reply_text.as_str(), text);
            }
            other => panic!("expected channel.close, got {other:?}"),
        }
    }

    /// A connection through the whole handshake with `config` and the
    /// client's tune-ok values.
    pub fn open_with(config: Config, frame_max: u32, heartbeat: u16) -> Self {
        let channel_max = config.channel_max;
        let mut h = Self::new(config);
        h.send(b"AMQP\x00\x00\x09\x01");
        h.send(&start_ok("guest", "guest", true));
        assert!(matches!(h.events().as_slice(), [Event::Authenticate(_)]));
        h.conn.accept_login();
        h.send(&tune_ok(channel_max, frame_max, heartbeat));
        h.send(&open("/"));
        assert!(matches!(h.events().as_slice(), [Event::OpenVhost { .. }]));
        h.conn.accept_vhost();
        h.resume();
        assert!(h.conn.is_open());
        h.output();
        h
    }

    /// A connection with default settings and `ch` open.
    pub fn with_channel(ch: u16) -> Self {
        let mut h = Self::open_with(Config::default(), 131_072, 0);
        h.send(&channel_open(ch));
        assert_eq!(h.events(), vec![Event::ChannelOpened(ch)]);
        h.output();
        h
    }
}

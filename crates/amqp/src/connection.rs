//! The per-connection AMQP 0-9-1 server state machine.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;

use amq_protocol::frame::parsing::parse_content_header;
use amq_protocol::protocol::{
    AMQPClass, BasicProperties, access, basic, channel, connection, parse_class,
};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, parsing::parse_field_table};
use bytes::{Buf, Bytes, BytesMut};

use crate::command::{Command, Publish, Reply, short};
use crate::depth::{check_content_header, check_method, check_table};
use crate::error::{AmqpError, ReplyCode};
use crate::frame::{
    CLASS_BASIC, ContentMethod, Encoder, FRAME_BODY, FRAME_END, FRAME_HEADER, FRAME_HEARTBEAT,
    FRAME_METHOD, FRAME_OVERHEAD, PROTOCOL_HEADER, PROTOCOL_HEADER_0_9, peek_header,
};

/// The smallest frame_max a client may ask for (RabbitMQ's `?FRAME_MIN_SIZE`).
pub const FRAME_MIN_SIZE: u32 = 4096;

/// A channel number.
pub type ChannelId = u16;

/// Server settings for one connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// `product` in the server properties.
    pub product: String,
    /// `version` in the server properties.
    pub version: String,
    /// `platform` in the server properties.
    pub platform: String,
    /// `cluster_name` in the server properties, if any.
    pub cluster_name: Option<String>,
    /// channel_max proposed in connection.tune (0 = no limit).
    pub channel_max: u16,
    /// frame_max proposed in connection.tune (0 = no limit; raised to
    /// [`FRAME_MIN_SIZE`] if smaller).
    pub frame_max: u32,
    /// heartbeat proposed in connection.tune, in seconds (0 = off).
    pub heartbeat_secs: u16,
    /// Largest message body accepted; larger ones are refused with 406.
    pub message_size_max: u64,
    /// Most body bytes of unfinished messages one connection may hold over
    /// all its channels; beyond it the connection is closed with 506.
    pub partial_content_max: u64,
    /// Time from the first tick to connection.open-ok before the socket is dropped.
    pub handshake_timeout_ms: u64,
    /// Time to wait for connection.close-ok after sending connection.close.
    pub close_timeout_ms: u64,
    /// How long a connection refused before tune-ok (a bad login, a frame
    /// error while starting) stays open before its socket is closed: as
    /// RabbitMQ's `SILENT_CLOSE_DELAY`, a client cannot retry logins as fast
    /// as it can connect.
    pub silent_close_ms: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            product: "Warren".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            platform: "Rust".into(),
            cluster_name: None,
            channel_max: 2047,
            frame_max: 131_072,
            heartbeat_secs: 60,
            message_size_max: 128 * 1024 * 1024,
            partial_content_max: 256 * 1024 * 1024,
            handshake_timeout_ms: 10_000,
            close_timeout_ms: 30_000,
            silent_close_ms: 3_000,
        }
    }
}

/// The SASL mechanism a client logged in with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mechanism {
    /// `PLAIN`: `\0user\0password`.
    Plain,
    /// `AMQPLAIN`: a field table with `LOGIN` and `PASSWORD`.
    AmqPlain,
}

impl Mechanism {
    /// The mechanism's name on the wire.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Plain => "PLAIN",
            Self::AmqPlain => "AMQPLAIN",
        }
    }
}

/// A user name and password from connection.start-ok.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// How the client sent them.
    pub mechanism: Mechanism,
    /// The user name.
    pub username: String,
    /// The password (not shown by `Debug`).
    pub password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("mechanism", &self.mechanism)
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// Why a connection ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CloseReason {
    /// The client sent connection.close (and got close-ok).
    ClientClosed {
        /// The client's reply code (200 for a normal close).
        reply_code: u16,
        /// The client's reply text.
        reply_text: String,
    },
    /// The server closed the connection with this error.
    ServerClosed(AmqpError),
    /// The client did not send the AMQP 0-9-1 protocol header.
    BadProtocolHeader,
    /// No bytes from the client for two heartbeat intervals.
    HeartbeatTimeout,
    /// The handshake did not finish within the handshake timeout.
    HandshakeTimeout,
}

/// What the state machine asks of the broker above.
// `Command::BasicPublish` is the large, hot variant: boxing it would cost an
// allocation per message.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Event {
    /// Check a login; answer with [`Connection::accept_login`] or
    /// [`Connection::refuse_login`]. Input is paused until then.
    Authenticate(Credentials),
    /// The client asks for a virtual host; answer with
    /// [`Connection::accept_vhost`] or [`Connection::refuse_vhost`].
    /// Input is paused until then.
    OpenVhost {
        /// The virtual host's name.
        vhost: String,
    },
    /// A channel was opened (open-ok already sent).
    ChannelOpened(ChannelId),
    /// A channel is gone: the client closed it (`error` is `None`) or the
    /// server closed it with `error`. Drop its consumers and unacked messages.
    ChannelClosed {
        /// The channel.
        channel: ChannelId,
        /// The server's error, if the server closed it.
        error: Option<AmqpError>,
    },
    /// A channel-level method for the broker.
    Command {
        /// The channel it came on.
        channel: ChannelId,
        /// The method.
        command: Command,
    },
    /// The connection is over, and with it every channel: write out the
    /// remaining output, then close the socket.
    Closed(CloseReason),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Header,
    StartOk,
    Authenticating,
    TuneOk,
    Open,
    OpeningVhost,
    Running,
    CloseSent,
    /// Refused before tune-ok, or after a frame error: input is dropped
    /// until the socket closes, [`Config::silent_close_ms`] later.
    Refusing,
    Closed,
}

impl State {
    fn name(self) -> &'static str {
        match self {
            Self::Header | Self::StartOk | Self::Authenticating => "starting",
            Self::TuneOk => "tuning",
            Self::Open | Self::OpeningVhost => "opening",
            Self::Running => "running",
            Self::CloseSent | Self::Refusing | Self::Closed => "closing",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum ChannelState {
    #[default]
    Free,
    Open,
    /// A fault found while reading waits behind the events read before it
    /// ([`Queued::ChannelFault`]): no more of its input is taken, but the
    /// replies to those events still go out, before its channel.close.
    Faulted,
    Closing,
}

/// An event for the broker, or a channel fault found while reading, raised
/// when the broker has taken the events read before it: replies to
/// pipelined methods keep their order and are not lost to a later
/// method's error (as RabbitMQ's channel answers them in turn).
#[derive(Debug)]
// Events are the common case: as large as a queue of events was before.
#[allow(clippy::large_enum_variant)]
enum Queued {
    Event(Event),
    ChannelFault(ChannelId, AmqpError),
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Mode {
    #[default]
    Plain,
    Confirm,
    Tx,
}

// One per channel; the large variant is the usual state while publishing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Default)]
enum Content {
    #[default]
    None,
    Header(basic::Publish),
    Body {
        publish: basic::Publish,
        properties: BasicProperties,
        remaining: u64,
        buf: BytesMut,
    },
}

#[derive(Debug, Default)]
struct Channel {
    state: ChannelState,
    content: Content,
    mode: Mode,
    publish_seq: u64,
}

#[derive(Clone, Copy, Debug, Default)]
struct ClientCaps {
    connection_blocked: bool,
    authentication_failure_close: bool,
    consumer_cancel_notify: bool,
}

/// How a fault is handled.
enum Fault {
    /// Close the channel with channel.close.
    Channel(ChannelId, AmqpError),
    /// Close the connection with connection.close and wait for close-ok.
    Connection(AmqpError),
    /// Send connection.close and drop the socket at once: the byte stream
    /// cannot be trusted any more (bad framing).
    Fatal(AmqpError),
}

type Outcome = Result<(), Fault>;

fn err(code: ReplyCode, text: impl Into<String>) -> AmqpError {
    AmqpError::new(code, text)
}

fn class_ids(class: &AMQPClass) -> (u16, u16) {
    (class.get_amqp_class_id(), class.get_amqp_method_id())
}

/// One client connection's AMQP 0-9-1 server side, without I/O.
///
/// A shell drives it like this:
///
/// 1. read socket bytes into a `BytesMut`, call [`handle_bytes`](Self::handle_bytes)
///    (it consumes every complete frame and leaves a partial one);
/// 2. drain [`poll_event`](Self::poll_event) and answer events with the
///    `accept_*`/`refuse_*`/[`reply`](Self::reply)/[`send_content`](Self::send_content)
///    methods; after answering `Authenticate` or `OpenVhost`, call
///    `handle_bytes` again, since input pauses while they are pending;
/// 3. call [`take_output`](Self::take_output) and write the bytes with one write;
/// 4. call [`handle_tick`](Self::handle_tick) with the current time in
///    milliseconds at [`poll_timeout`](Self::poll_timeout) (or more often);
/// 5. after [`Event::Closed`], write the remaining output and close the socket.
#[derive(Debug)]
pub struct Connection {
    config: Config,
    state: State,
    enc: Encoder,
    events: VecDeque<Queued>,
    /// The channels not free, by number (opened ones only: any number up
    /// to 65535 may be opened, as in RabbitMQ, so no dense table).
    channels: BTreeMap<ChannelId, Channel>,
    channels_open: usize,
    frame_max: u32,
    channel_max: u16,
    heartbeat_secs: u16,
    client_properties: FieldTable,
    caps: ClientCaps,
    mechanism: Option<Mechanism>,
    username: String,
    vhost: String,
    blocked: bool,
    /// A resource alarm holds publishes: input stops after content frames.
    holding: bool,
    published: bool,
    /// At least the body bytes buffered in unfinished messages (exact after
    /// [`Connection::partial_content`] recounts it).
    partial_bytes: u64,
    close_error: Option<AmqpError>,
    prefetch_size: u32,
    started_ms: Option<u64>,
    close_started_ms: Option<u64>,
    last_recv_ms: Option<u64>,
    last_send_ms: Option<u64>,
    recv_activity: bool,
    send_activity: bool,
    /// The client closed the connection (connection.close, answered with
    /// close-ok): what it still sends is read by [`Self::after_close`].
    client_closed: bool,
    /// Bytes of the frame being skipped after the client's close.
    discarding: usize,
}

impl Connection {
    /// A new connection waiting for the client's protocol header.
    #[must_use]
    pub fn new(mut config: Config) -> Self {
        if config.frame_max != 0 {
            // The spec's floor; smaller values could not even carry start-ok.
            config.frame_max = config.frame_max.max(FRAME_MIN_SIZE);
        }
        let frame_max = config.frame_max;
        Self {
            config,
            state: State::Header,
            enc: Encoder::default(),
            events: VecDeque::new(),
            channels: BTreeMap::new(),
            channels_open: 0,
            frame_max,
            channel_max: 0,
            heartbeat_secs: 0,
            client_properties: FieldTable::default(),
            caps: ClientCaps::default(),
            mechanism: None,
            username: String::new(),
            vhost: String::new(),
            blocked: false,
            holding: false,
            published: false,
            partial_bytes: 0,
            close_error: None,
            prefetch_size: 0,
            started_ms: None,
            close_started_ms: None,
            last_recv_ms: None,
            last_send_ms: None,
            recv_activity: false,
            send_activity: false,
            client_closed: false,
            discarding: 0,
        }
    }

    // ----- accessors -------------------------------------------------------

    /// Whether the handshake is done and the connection is usable.
    #[must_use]
    pub fn is_open(&self) -> bool {
        self.state == State::Running
    }

    /// Whether connection.close was sent and the connection is ending: its
    /// input is read only to find close-ok, and content is discarded.
    #[must_use]
    pub fn is_closing(&self) -> bool {
        matches!(
            self.state,
            State::CloseSent | State::Refusing | State::Closed
        )
    }

    /// Whether the connection is over ([`Event::Closed`] was emitted).
    #[must_use]
    pub fn is_closed(&self) -> bool {
        self.state == State::Closed
    }

    /// Whether `channel` is open (not free, not closing).
    #[must_use]
    pub fn is_channel_open(&self, channel: ChannelId) -> bool {
        matches!(
            self.channel_state(channel),
            ChannelState::Open | ChannelState::Faulted
        )
    }

    /// Whether tune-ok has fixed frame_max and channel_max.
    fn tuned(&self) -> bool {
        !matches!(
            self.state,
            State::Header | State::StartOk | State::Authenticating | State::TuneOk
        )
    }

    /// The negotiated frame_max (0 = no limit; the server's proposal before tune-ok).
    #[must_use]
    pub fn frame_max(&self) -> u32 {
        self.frame_max
    }

    /// The negotiated channel_max.
    #[must_use]
    pub fn channel_max(&self) -> u16 {
        self.channel_max
    }

    /// The negotiated heartbeat in seconds (0 = off).
    #[must_use]
    pub fn heartbeat_secs(&self) -> u16 {
        self.heartbeat_secs
    }

    /// The client properties from start-ok.
    #[must_use]
    pub fn client_properties(&self) -> &FieldTable {
        &self.client_properties
    }

    /// The SASL mechanism the client logged in with (none before start-ok).
    #[must_use]
    pub fn mechanism(&self) -> Option<Mechanism> {
        self.mechanism
    }

    /// The authenticated (or authenticating) user name.
    #[must_use]
    pub fn username(&self) -> &str {
        &self.username
    }

    /// The virtual host asked for in connection.open.
    #[must_use]
    pub fn vhost(&self) -> &str {
        &self.vhost
    }

    /// Whether the client has begun to publish: a basic.publish method has
    /// arrived, whether or not its content is complete yet. A resource alarm
    /// holds such a connection's input from that moment on.
    #[must_use]
    pub fn has_published(&self) -> bool {
        self.published
    }

    /// Whether connection.blocked was sent and not yet lifted.
    #[must_use]
    pub fn is_blocked(&self) -> bool {
        self.blocked
    }

    /// Whether there are bytes waiting in [`take_output`](Self::take_output).
    #[must_use]
    pub fn has_output(&self) -> bool {
        !self.enc.out.is_empty()
    }

    // ----- output side -----------------------------------------------------

    /// Whether events wait to be taken with [`poll_event`](Self::poll_event).
    #[must_use]
    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// The next event for the broker, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        loop {
            match self.events.pop_front()? {
                Queued::Event(e) => return Some(e),
                Queued::ChannelFault(ch, e) => self.channel_error(ch, e),
            }
        }
    }

    fn push_event(&mut self, e: Event) {
        self.events.push_back(Queued::Event(e));
    }

    /// Whether replies may go out on `channel`: open, or faulted with its
    /// earlier events still being answered.
    fn can_send(&self, channel: ChannelId) -> bool {
        self.state == State::Running
            && matches!(
                self.channel_state(channel),
                ChannelState::Open | ChannelState::Faulted
            )
    }

    /// Moves every encoded frame into `dst` (zero-copy when `dst` is empty),
    /// to be written with one write.
    pub fn take_output(&mut self, dst: &mut BytesMut) {
        if self.enc.out.is_empty() {
            return;
        }
        self.send_activity = true;
        if dst.is_empty() {
            *dst = self.enc.out.split();
        } else {
            dst.extend_from_slice(&self.enc.out);
            self.enc.out.clear();
        }
    }

    /// Bytes of encoded output not yet taken: a mark for
    /// [`split_output`](Self::split_output).
    #[must_use]
    pub fn output_len(&self) -> usize {
        self.enc.out.len()
    }

    /// Removes and returns the output encoded since `mark` (an earlier
    /// [`output_len`](Self::output_len), with no take in between): the
    /// reply to a command that must wait, sent later with
    /// [`push_output`](Self::push_output) or dropped.
    pub fn split_output(&mut self, mark: usize) -> BytesMut {
        self.enc.out.split_off(mark.min(self.enc.out.len()))
    }

    /// Appends frames encoded earlier (see [`split_output`](Self::split_output)).
    pub fn push_output(&mut self, frames: &[u8]) {
        self.enc.out.extend_from_slice(frames);
    }

    // ----- input side ------------------------------------------------------

    /// Consumes every complete frame in `buf`, leaving an incomplete one.
    ///
    /// Input pauses (bytes stay in `buf`) while an `Authenticate` or
    /// `OpenVhost` event waits for its answer; once closed, input is dropped
    /// (after a client's own close, but for a connection.close, which gets
    /// close-ok again: keep feeding it until the client closes the socket).
    pub fn handle_bytes(&mut self, buf: &mut BytesMut) {
        if !buf.is_empty() {
            self.recv_activity = true;
        }
        loop {
            match self.state {
                State::Closed if self.client_closed => {
                    self.after_close(buf);
                    return;
                }
                State::Closed | State::Refusing => {
                    buf.clear();
                    return;
                }
                State::Authenticating | State::OpeningVhost => return,
                State::Header => {
                    if !self.handle_protocol_header(buf) {
                        return;
                    }
                    continue;
                }
                _ => {}
            }
            let Some(h) = peek_header(buf) else { return };
            // Until tune-ok has agreed a frame_max, RabbitMQ's floor holds:
            // a client cannot make the server buffer a large frame before
            // it has logged in.
            let frame_max = if self.tuned() {
                self.frame_max
            } else {
                FRAME_MIN_SIZE
            };
            // As RabbitMQ's reader, a payload of up to frame_max bytes
            // passes (it allows clients that leave out the frame's own 8
            // bytes that much); a larger one is a frame error.
            let limit = if frame_max == 0 {
                u32::MAX as usize
            } else {
                frame_max as usize
            };
            if h.size as usize > limit {
                self.fault(Fault::Fatal(err(
                    ReplyCode::FrameError,
                    format!(
                        "frame size {} exceeds {} frame_max {frame_max}",
                        h.size as usize + FRAME_OVERHEAD,
                        if self.tuned() {
                            "negotiated"
                        } else {
                            "the pre-tune"
                        },
                    ),
                )));
                continue;
            }
            let total = h.size as usize + FRAME_OVERHEAD;
            if buf.len() < total {
                buf.reserve(total - buf.len());
                return;
            }
            if buf[total - 1] != FRAME_END {
                self.fault(Fault::Fatal(err(
                    ReplyCode::FrameError,
                    format!(
                        "type {}, channel {}: invalid frame end marker {:#04x}",
                        h.frame_type,
                        h.channel,
                        buf[total - 1]
                    ),
                )));
                continue;
            }
            let outcome = match h.frame_type {
                FRAME_METHOD => {
                    let parsed = parse_method(&buf[7..total - 1]);
                    buf.advance(total);
                    match parsed {
                        Ok((class, prefetch_size)) => {
                            self.prefetch_size = prefetch_size;
                            self.on_method(h.channel, class)
                        }
                        Err(e) if self.state == State::CloseSent => {
                            let _ = e;
                            Ok(())
                        }
                        Err(e) => Err(Fault::Connection(e)),
                    }
                }
                FRAME_HEADER => {
                    let payload = &buf[7..total - 1];
                    // The weight, which the codec does not keep.
                    let weight = payload
                        .get(2..4)
                        .map_or(0, |w| u16::from_be_bytes([w[0], w[1]]));
                    let parsed = match check_content_header(payload) {
                        Err(e) => Err(format!("content header: {e}")),
                        Ok(()) => match parse_content_header(payload) {
                            Ok(([], header)) => Ok(header),
                            _ => Err("cannot decode content header".to_owned()),
                        },
                    };
                    buf.advance(total);
                    match parsed {
                        Ok(header) => self.on_header(
                            h.channel,
                            header.class_id,
                            weight,
                            header.body_size,
                            header.properties,
                        ),
                        _ if self.state == State::CloseSent => Ok(()),
                        Err(text) => Err(Fault::Connection(err(ReplyCode::SyntaxError, text))),
                    }
                }
                FRAME_BODY => {
                    let frame = buf.split_to(total).freeze();
                    self.on_body(h.channel, frame.slice(7..total - 1))
                }
                FRAME_HEARTBEAT => {
                    buf.advance(total);
                    if h.size != 0 {
                        Err(Fault::Fatal(err(
                            ReplyCode::FrameError,
                            format!("heartbeat frame with {} payload bytes", h.size),
                        )))
                    } else if h.channel != 0 {
                        Err(Fault::Connection(err(
                            ReplyCode::UnexpectedFrame,
                            format!("heartbeat frame on channel {}", h.channel),
                        )))
                    } else {
                        Ok(())
                    }
                }
                other => Err(Fault::Fatal(err(
                    ReplyCode::FrameError,
                    format!("unknown frame type {other}"),
                ))),
            };
            if let Err(f) = outcome {
                self.read_fault(f);
            }
            // A resource alarm: after a content frame, as RabbitMQ's reader
            // does, nothing more is read until the alarm clears.
            if self.holding
                && matches!(h.frame_type, FRAME_HEADER | FRAME_BODY)
                && self.state == State::Running
            {
                return;
            }
        }
    }

    /// Handles the 8-byte protocol header; returns whether to go on.
    fn handle_protocol_header(&mut self, buf: &mut BytesMut) -> bool {
        let n = buf.len().min(8);
        // AMQP 0-9's header is taken for 0-9-1, as RabbitMQ takes it.
        if buf[..n] != PROTOCOL_HEADER[..n] && buf[..n] != PROTOCOL_HEADER_0_9[..n] {
            // Refuse early: anything that does not start like our header.
            return self.bad_protocol_header(buf);
        }
        if n < 8 {
            return false;
        }
        buf.advance(8);
        self.send_start();
        self.state = State::StartOk;
        true
    }

    fn bad_protocol_header(&mut self, buf: &mut BytesMut) -> bool {
        // The spec: answer with the header we support, then close.
        self.enc.protocol_header();
        buf.clear();
        self.finish(CloseReason::BadProtocolHeader);
        false
    }

    fn send_start(&mut self) {
        let mut caps = FieldTable::default();
        for cap in [
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
            caps.insert(cap.into(), AMQPValue::Boolean(true));
        }
        let mut props = FieldTable::default();
        let s = |v: &str| AMQPValue::LongString(LongString::from(v.as_bytes().to_vec()));
        props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
        props.insert("product".into(), s(&self.config.product));
        props.insert("version".into(), s(&self.config.version));
        props.insert("platform".into(), s(&self.config.platform));
        if let Some(name) = &self.config.cluster_name {
            props.insert("cluster_name".into(), s(name));
        }
        props.insert("copyright".into(), s("Copyright (c) the Warren authors"));
        props.insert("information".into(), s("Licensed under MIT OR Apache-2.0"));
        self.enc.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
                version_major: 0,
                version_minor: 9,
                server_properties: props,
                mechanisms: "PLAIN AMQPLAIN".into(),
                locales: "en_US".into(),
            })),
        );
    }

    fn on_method(&mut self, ch: ChannelId, class: AMQPClass) -> Outcome {
        if self.state == State::CloseSent {
            // After our connection.close only close-ok (or a crossing close) counts.
            if ch == 0 {
                match class {
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)) => {
                        let e = self.close_error.take().unwrap_or_else(|| {
                            err(ReplyCode::InternalError, "closed without an error")
                        });
                        self.finish(CloseReason::ServerClosed(e));
                    }
                    AMQPClass::Connection(connection::AMQPMethod::Close(_)) => {
                        self.send_close_ok();
                        let e = self.close_error.take().unwrap_or_else(|| {
                            err(ReplyCode::InternalError, "closed without an error")
                        });
                        self.finish(CloseReason::ServerClosed(e));
                    }
                    _ => {}
                }
            }
            return Ok(());
        }
        if ch == 0 {
            return self.on_connection_method(class);
        }
        if self.state != State::Running {
            let (c, m) = class_ids(&class);
            return Err(Fault::Connection(
                err(
                    ReplyCode::UnexpectedFrame,
                    format!(
                        "unexpected method on channel {ch} in connection state {}",
                        self.state.name()
                    ),
                )
                .with_method(c, m),
            ));
        }
        self.on_channel_method(ch, class)
    }

    fn on_connection_method(&mut self, class: AMQPClass) -> Outcome {
        use connection::AMQPMethod as M;
        let (c, m) = class_ids(&class);
        let AMQPClass::Connection(method) = class else {
            return Err(Fault::Connection(
                err(
                    ReplyCode::ChannelError,
                    format!(
                        "unexpected method in connection state {}",
                        self.state.name()
                    ),
                )
                .with_method(c, m),
            ));
        };
        match (self.state, method) {
            (_, M::Close(close)) => {
                self.send_close_ok();
                self.client_closed = true;
                self.finish(CloseReason::ClientClosed {
                    reply_code: close.reply_code,
                    reply_text: close.reply_text.to_string(),
                });
                Ok(())
            }
            (State::StartOk, M::StartOk(start_ok)) => self.on_start_ok(start_ok),
            (State::TuneOk, M::TuneOk(tune_ok)) => self.on_tune_ok(tune_ok),
            (State::Open, M::Open(open)) => {
                self.vhost = open.virtual_host.to_string();
                self.state = State::OpeningVhost;
                self.push_event(Event::OpenVhost {
                    vhost: self.vhost.clone(),
                });
                Ok(())
            }
            (State::Running, M::UpdateSecret(u)) => {
                // Warren's users are internal ones whose login never expires:
                // as RabbitMQ's internal backend, the new secret is taken as
                // it is and nothing else changes.
                tracing::info!(
                    user = %self.username,
                    reason = %u.reason.as_str().escape_debug(),
                    "user updated secret"
                );
                self.enc.method(
                    0,
                    AMQPClass::Connection(M::UpdateSecretOk(connection::UpdateSecretOk {})),
                );
                Ok(())
            }
            (state, _) => Err(Fault::Connection(
                err(
                    ReplyCode::ChannelError,
                    format!("unexpected method in connection state {}", state.name()),
                )
                .with_method(c, m),
            )),
        }
    }

    fn on_start_ok(&mut self, start_ok: connection::StartOk) -> Outcome {
        if let Some(AMQPValue::FieldTable(caps)) =
            start_ok.client_properties.inner().get("capabilities")
        {
            let flag = |k: &str| matches!(caps.inner().get(k), Some(AMQPValue::Boolean(true)));
            self.caps = ClientCaps {
                connection_blocked: flag("connection.blocked"),
                authentication_failure_close: flag("authentication_failure_close"),
                consumer_cancel_notify: flag("consumer_cancel_notify"),
            };
        }
        self.client_properties = start_ok.client_properties;
        let mechanism = match start_ok.mechanism.as_str() {
            "PLAIN" => Mechanism::Plain,
            "AMQPLAIN" => Mechanism::AmqPlain,
            other => {
                return Err(Fault::Connection(
                    err(
                        ReplyCode::CommandInvalid,
                        format!("unknown authentication mechanism '{other}'"),
                    )
                    .with_method(10, 11),
                ));
            }
        };
        self.mechanism = Some(mechanism);
        let response = start_ok.response.as_bytes();
        let parsed = match mechanism {
            Mechanism::Plain => parse_plain(response),
            Mechanism::AmqPlain => parse_amqplain(response),
        };
        let Some((username, password)) = parsed else {
            self.state = State::Authenticating;
            self.refuse_login();
            return Ok(());
        };
        self.username.clone_from(&username);
        self.state = State::Authenticating;
        self.push_event(Event::Authenticate(Credentials {
            mechanism,
            username,
            password,
        }));
        Ok(())
    }

    fn on_tune_ok(&mut self, t: connection::TuneOk) -> Outcome {
        negotiate(
            "frame_max",
            FRAME_MIN_SIZE,
            self.config.frame_max,
            t.frame_max,
        )?;
        negotiate(
            "channel_max",
            1,
            u32::from(self.config.channel_max),
            u32::from(t.channel_max),
        )?;
        self.frame_max = t.frame_max;
        self.channel_max = if t.channel_max == 0 {
            u16::MAX
        } else {
            t.channel_max
        };
        self.heartbeat_secs = t.heartbeat;
        self.state = State::Open;
        Ok(())
    }

    fn channel_state(&self, ch: ChannelId) -> ChannelState {
        self.channels
            .get(&ch)
            .map_or(ChannelState::Free, |c| c.state)
    }

    fn channel_mut(&mut self, ch: ChannelId) -> &mut Channel {
        self.channels.entry(ch).or_default()
    }

    /// An open or closing channel's state, for the paths that checked it.
    fn open_channel(&mut self, ch: ChannelId) -> &mut Channel {
        self.channels.get_mut(&ch).expect("an open channel")
    }

    fn free_channel(&mut self, ch: ChannelId) {
        if self
            .channels
            .remove(&ch)
            .is_some_and(|c| c.state != ChannelState::Free)
        {
            self.channels_open -= 1;
        }
    }

    fn on_channel_method(&mut self, ch: ChannelId, class: AMQPClass) -> Outcome {
        use AMQPClass as C;
        let (c, m) = class_ids(&class);
        let conn_err = |code, text: &str| Err(Fault::Connection(err(code, text).with_method(c, m)));
        match self.channel_state(ch) {
            ChannelState::Free => match class {
                C::Channel(channel::AMQPMethod::Open(_)) => {
                    // RabbitMQ limits how many channels are open, not
                    // their numbers (any up to 65535).
                    if self.channels_open >= usize::from(self.channel_max) {
                        return Err(Fault::Connection(
                            err(
                                ReplyCode::NotAllowed,
                                format!(
                                    "number of channels opened ({}) has reached the negotiated channel_max ({})",
                                    self.channels_open, self.channel_max
                                ),
                            )
                            .with_method(c, m),
                        ));
                    }
                    *self.channel_mut(ch) = Channel {
                        state: ChannelState::Open,
                        ..Channel::default()
                    };
                    self.channels_open += 1;
                    self.enc.method(
                        ch,
                        C::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
                    );
                    self.push_event(Event::ChannelOpened(ch));
                    Ok(())
                }
                C::Channel(channel::AMQPMethod::CloseOk(_)) => Ok(()),
                _ => conn_err(ReplyCode::ChannelError, "expected 'channel.open'"),
            },
            ChannelState::Closing | ChannelState::Faulted => {
                match class {
                    C::Channel(channel::AMQPMethod::CloseOk(_)) => self.free_channel(ch),
                    C::Channel(channel::AMQPMethod::Close(_)) => {
                        self.send_channel_close_ok(ch);
                        self.free_channel(ch);
                    }
                    _ => {}
                }
                Ok(())
            }
            ChannelState::Open => {
                match self.channels[&ch].content {
                    Content::None => {}
                    Content::Header(_) => {
                        return conn_err(
                            ReplyCode::UnexpectedFrame,
                            "expected content header for class 60, got non content header frame instead",
                        );
                    }
                    Content::Body { .. } => {
                        return conn_err(
                            ReplyCode::UnexpectedFrame,
                            "expected content body, got non content body frame instead",
                        );
                    }
                }
                self.on_open_channel_method(ch, class)
            }
        }
    }

    fn on_open_channel_method(&mut self, ch: ChannelId, class: AMQPClass) -> Outcome {
        use AMQPClass as C;
        use basic::AMQPMethod as B;
        let (c, m) = class_ids(&class);
        let conn_err =
            |code, text: String| Err(Fault::Connection(err(code, text).with_method(c, m)));
        let ch_err = |code, text: &str| Err(Fault::Channel(ch, err(code, text).with_method(c, m)));
        let command = match class {
            C::Channel(channel::AMQPMethod::Open(_)) => {
                return conn_err(ReplyCode::ChannelError, "second 'channel.open' seen".into());
            }
            C::Channel(channel::AMQPMethod::Close(_)) => {
                self.send_channel_close_ok(ch);
                self.free_channel(ch);
                self.push_event(Event::ChannelClosed {
                    channel: ch,
                    error: None,
                });
                return Ok(());
            }
            C::Channel(channel::AMQPMethod::Flow(flow)) => {
                if !flow.active {
                    return conn_err(ReplyCode::NotImplemented, "active=false".into());
                }
                self.enc.method(
                    ch,
                    C::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk {
                        active: true,
                    })),
                );
                return Ok(());
            }
            // No channel.close of ours to answer: RabbitMQ's channel takes
            // it as a method it does not implement (a connection error).
            C::Channel(channel::AMQPMethod::CloseOk(_)) => {
                return conn_err(ReplyCode::CommandInvalid, "unimplemented method".into());
            }
            C::Channel(channel::AMQPMethod::FlowOk(_)) | C::Basic(B::CancelOk(_)) => return Ok(()),
            C::Access(access::AMQPMethod::Request(_)) => {
                self.enc.method(
                    ch,
                    C::Access(access::AMQPMethod::RequestOk(access::RequestOk {})),
                );
                return Ok(());
            }
            C::Basic(B::Publish(publish)) => {
                if publish.immediate {
                    return conn_err(ReplyCode::NotImplemented, "immediate=true".into());
                }
                self.open_channel(ch).content = Content::Header(publish);
                self.published = true;
                return Ok(());
            }
            C::Basic(B::Qos(qos)) => {
                if self.prefetch_size != 0 {
                    return conn_err(
                        ReplyCode::NotImplemented,
                        format!("prefetch_size!=0 ({})", self.prefetch_size),
                    );
                }
                Command::BasicQos(qos)
            }
            C::Basic(B::Consume(x)) => Command::BasicConsume(x),
            C::Basic(B::Cancel(x)) => Command::BasicCancel(x),
            C::Basic(B::Get(x)) => Command::BasicGet(x),
            C::Basic(B::Ack(x)) => Command::BasicAck(x),
            C::Basic(B::Nack(x)) => Command::BasicNack(x),
            C::Basic(B::Reject(x)) => Command::BasicReject(x),
            C::Basic(B::Recover(x)) => Command::BasicRecover(x),
            C::Basic(B::RecoverAsync(x)) => Command::BasicRecoverAsync(x),
            C::Exchange(e) => {
                use amq_protocol::protocol::exchange::AMQPMethod as E;
                match e {
                    E::Declare(x) => Command::ExchangeDeclare(x),
                    E::Delete(x) => Command::ExchangeDelete(x),
                    E::Bind(x) => Command::ExchangeBind(x),
                    E::Unbind(x) => Command::ExchangeUnbind(x),
                    _ => return conn_err(ReplyCode::CommandInvalid, "unimplemented method".into()),
                }
            }
            C::Queue(q) => {
                use amq_protocol::protocol::queue::AMQPMethod as Q;
                match q {
                    Q::Declare(x) => Command::QueueDeclare(x),
                    Q::Bind(x) => Command::QueueBind(x),
                    Q::Unbind(x) => Command::QueueUnbind(x),
                    Q::Purge(x) => Command::QueuePurge(x),
                    Q::Delete(x) => Command::QueueDelete(x),
                    _ => return conn_err(ReplyCode::CommandInvalid, "unimplemented method".into()),
                }
            }
            C::Confirm(amq_protocol::protocol::confirm::AMQPMethod::Select(x)) => {
                let chan = self.channels.get_mut(&ch).expect("an open channel");
                if chan.mode == Mode::Tx {
                    return ch_err(
                        ReplyCode::PreconditionFailed,
                        "cannot switch from tx to confirm mode",
                    );
                }
                chan.mode = Mode::Confirm;
                Command::ConfirmSelect(x)
            }
            C::Tx(t) => {
                use amq_protocol::protocol::tx::AMQPMethod as T;
                let chan = self.channels.get_mut(&ch).expect("an open channel");
                match t {
                    T::Select(_) => {
                        if chan.mode == Mode::Confirm {
                            return ch_err(
                                ReplyCode::PreconditionFailed,
                                "cannot switch from confirm to tx mode",
                            );
                        }
                        chan.mode = Mode::Tx;
                        Command::TxSelect
                    }
                    T::Commit(_) | T::Rollback(_) if chan.mode != Mode::Tx => {
                        return ch_err(
                            ReplyCode::PreconditionFailed,
                            "channel is not transactional",
                        );
                    }
                    T::Commit(_) => Command::TxCommit,
                    T::Rollback(_) => Command::TxRollback,
                    _ => return conn_err(ReplyCode::CommandInvalid, "unimplemented method".into()),
                }
            }
            C::Connection(_) => {
                return conn_err(
                    ReplyCode::CommandInvalid,
                    "connection methods must be sent on channel 0".into(),
                );
            }
            _ => return conn_err(ReplyCode::CommandInvalid, "unimplemented method".into()),
        };
        self.push_event(Event::Command {
            channel: ch,
            command,
        });
        Ok(())
    }

    fn content_frame_check(&self, ch: ChannelId) -> Result<bool, Fault> {
        if self.state == State::CloseSent {
            return Ok(false);
        }
        if ch == 0 || self.state != State::Running {
            return Err(Fault::Connection(err(
                ReplyCode::UnexpectedFrame,
                format!(
                    "content frame on channel {ch} in connection state {}",
                    self.state.name()
                ),
            )));
        }
        match self.channel_state(ch) {
            ChannelState::Free => Err(Fault::Connection(err(
                ReplyCode::ChannelError,
                "expected 'channel.open'",
            ))),
            ChannelState::Closing | ChannelState::Faulted => Ok(false),
            ChannelState::Open => Ok(true),
        }
    }

    fn on_header(
        &mut self,
        ch: ChannelId,
        class_id: u16,
        weight: u16,
        body_size: u64,
        properties: BasicProperties,
    ) -> Outcome {
        if !self.content_frame_check(ch)? {
            return Ok(());
        }
        let max = self.config.message_size_max;
        let chan = self.channels.get_mut(&ch).expect("an open channel");
        let publish = match std::mem::take(&mut chan.content) {
            Content::Header(p) => p,
            Content::None => {
                return Err(Fault::Connection(err(
                    ReplyCode::UnexpectedFrame,
                    "expected method frame, got non method frame instead",
                )));
            }
            Content::Body { .. } => {
                return Err(Fault::Connection(err(
                    ReplyCode::UnexpectedFrame,
                    "expected content body, got non content body frame instead",
                )));
            }
        };
        if class_id != CLASS_BASIC {
            return Err(Fault::Connection(err(
                ReplyCode::UnexpectedFrame,
                format!(
                    "expected content header for class 60, got one for class {class_id} instead"
                ),
            )));
        }
        if weight != 0 {
            // The spec's weight is always 0: RabbitMQ's assembler takes a
            // header with another as no header at all.
            return Err(Fault::Connection(
                err(
                    ReplyCode::UnexpectedFrame,
                    "expected content header for class 60, got non content header frame instead",
                )
                .with_method(60, 40),
            ));
        }
        if body_size > max {
            return Err(Fault::Channel(
                ch,
                err(
                    ReplyCode::PreconditionFailed,
                    format!("message size {body_size} is larger than configured max size {max}"),
                )
                .with_method(60, 40),
            ));
        }
        if body_size == 0 {
            self.complete_publish(ch, publish, properties, Bytes::new());
            return Ok(());
        }
        chan.content = Content::Body {
            publish,
            properties,
            remaining: body_size,
            buf: BytesMut::new(),
        };
        Ok(())
    }

    /// The body bytes buffered in unfinished messages, over every channel.
    fn partial_content(&self) -> u64 {
        self.channels
            .values()
            .map(|c| match &c.content {
                Content::Body { buf, .. } => buf.len() as u64,
                _ => 0,
            })
            .sum()
    }

    fn on_body(&mut self, ch: ChannelId, body: Bytes) -> Outcome {
        if !self.content_frame_check(ch)? {
            return Ok(());
        }
        let limit = self.config.partial_content_max;
        if self.partial_bytes.saturating_add(body.len() as u64) > limit {
            // The counter only grows between recounts: recount, then judge.
            self.partial_bytes = self.partial_content();
            if self.partial_bytes.saturating_add(body.len() as u64) > limit {
                return Err(Fault::Connection(err(
                    ReplyCode::ResourceError,
                    format!("unfinished messages on this connection exceed {limit} bytes"),
                )));
            }
        }
        let chan = self.channels.get_mut(&ch).expect("an open channel");
        let Content::Body { remaining, buf, .. } = &mut chan.content else {
            let text = if matches!(chan.content, Content::Header(_)) {
                "expected content header for class 60, got non content header frame instead"
            } else {
                "expected method frame, got non method frame instead"
            };
            return Err(Fault::Connection(err(ReplyCode::UnexpectedFrame, text)));
        };
        let len = body.len() as u64;
        if len > *remaining {
            return Err(Fault::Connection(err(
                ReplyCode::UnexpectedFrame,
                format!(
                    "content body frame of {len} bytes exceeds the {} bytes left of the declared body size",
                    *remaining
                ),
            )));
        }
        *remaining -= len;
        let complete = if *remaining == 0 {
            if buf.is_empty() {
                Some(body)
            } else {
                self.partial_bytes = self.partial_bytes.saturating_sub(buf.len() as u64);
                buf.extend_from_slice(&body);
                Some(std::mem::take(buf).freeze())
            }
        } else {
            if buf.is_empty() {
                // Grow as data comes rather than trusting the declared size.
                let want = (len + *remaining).min(1 << 20) as usize;
                buf.reserve(want);
            }
            buf.extend_from_slice(&body);
            self.partial_bytes += len;
            None
        };
        if let Some(body) = complete
            && let Content::Body {
                publish,
                properties,
                ..
            } = std::mem::take(&mut chan.content)
        {
            self.complete_publish(ch, publish, properties, body);
        }
        Ok(())
    }

    fn complete_publish(
        &mut self,
        ch: ChannelId,
        publish: basic::Publish,
        properties: BasicProperties,
        body: Bytes,
    ) {
        let chan = self.channels.get_mut(&ch).expect("an open channel");
        let confirm_seq = if chan.mode == Mode::Confirm {
            chan.publish_seq += 1;
            Some(chan.publish_seq)
        } else {
            None
        };
        self.push_event(Event::Command {
            channel: ch,
            command: Command::BasicPublish(Publish {
                exchange: publish.exchange,
                routing_key: publish.routing_key,
                mandatory: publish.mandatory,
                properties,
                body,
                confirm_seq,
            }),
        });
    }

    // ----- faults and closing ---------------------------------------------

    /// A fault found while reading: a channel's waits behind the events
    /// read before it (see [`Queued`]); the others act at once.
    fn read_fault(&mut self, fault: Fault) {
        match fault {
            Fault::Channel(ch, e)
                if !e.code.is_hard()
                    && ch != 0
                    && self.state == State::Running
                    && self.channel_state(ch) == ChannelState::Open
                    && !self.events.is_empty() =>
            {
                let chan = self.channel_mut(ch);
                chan.state = ChannelState::Faulted;
                chan.content = Content::None;
                self.events.push_back(Queued::ChannelFault(ch, e));
            }
            f => self.fault(f),
        }
    }

    fn fault(&mut self, fault: Fault) {
        match fault {
            Fault::Channel(ch, e) => self.channel_error(ch, e),
            Fault::Connection(e) => self.connection_error(e),
            Fault::Fatal(e) if self.starting() => self.refuse(e),
            Fault::Fatal(e) => {
                if self.state == State::CloseSent {
                    let e = self.close_error.take().unwrap_or(e);
                    self.finish(CloseReason::ServerClosed(e));
                    return;
                }
                tracing::debug!(code = e.code.code(), text = %e.text, "fatal AMQP frame error");
                // As RabbitMQ: connection.close, then nothing more is read
                // and the socket closes a moment later.
                self.send_connection_close(&e);
                self.refuse(e);
            }
        }
    }

    fn send_connection_close(&mut self, e: &AmqpError) {
        self.enc.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: e.code.code(),
                reply_text: e.reply_text().into(),
                class_id: e.class_id,
                method_id: e.method_id,
            })),
        );
    }

    fn send_close_ok(&mut self) {
        self.enc.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
        );
    }

    /// After close-ok to the client's connection.close the socket is the
    /// client's to close, as with RabbitMQ: what the client still sends is
    /// discarded, frame by frame, but each further connection.close gets
    /// close-ok again, as RabbitMQ answers it (a client whose threads close
    /// the connection at once may send several, each waiting for its answer).
    fn after_close(&mut self, buf: &mut BytesMut) {
        loop {
            let n = self.discarding.min(buf.len());
            buf.advance(n);
            self.discarding -= n;
            if self.discarding > 0 {
                return;
            }
            let Some(h) = peek_header(buf) else { return };
            // The class and method ids follow the 7-byte header.
            if h.size >= 4 && buf.len() < 11 {
                return;
            }
            if h.frame_type == FRAME_METHOD && h.channel == 0 && buf[7..11] == [0, 10, 0, 50] {
                self.send_close_ok();
            }
            self.discarding = h.size as usize + FRAME_OVERHEAD;
        }
    }

    fn send_channel_close_ok(&mut self, ch: ChannelId) {
        self.enc.method(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
        );
    }

    fn finish(&mut self, reason: CloseReason) {
        if self.state == State::Closed {
            return;
        }
        self.state = State::Closed;
        self.channels.clear();
        self.channels_open = 0;
        self.push_event(Event::Closed(reason));
    }

    /// Closes the connection with `error` (connection.close), as for any
    /// hard error; e.g. 320 CONNECTION_FORCED on shutdown. Everything but
    /// close-ok is ignored afterwards; [`Event::Closed`] follows close-ok or
    /// the close timeout.
    pub fn connection_error(&mut self, error: AmqpError) {
        match self.state {
            State::Closed | State::CloseSent | State::Refusing => {}
            State::Header => self.finish(CloseReason::ServerClosed(error)),
            _ if self.starting() => self.refuse(error),
            _ => {
                tracing::debug!(code = error.code.code(), text = %error.text, "closing AMQP connection");
                self.send_connection_close(&error);
                self.state = State::CloseSent;
                self.close_error = Some(error);
                self.close_started_ms = None;
                self.channels.clear();
                self.channels_open = 0;
            }
        }
    }

    /// Whether the connection is before tune-ok, where RabbitMQ answers an
    /// error by closing the socket, without connection.close, after
    /// [`Config::silent_close_ms`].
    fn starting(&self) -> bool {
        matches!(
            self.state,
            State::StartOk | State::Authenticating | State::TuneOk
        )
    }

    /// Ends a connection that is still starting, or whose input cannot be
    /// framed any more: nothing more is read or answered, and
    /// [`Event::Closed`] comes after [`Config::silent_close_ms`].
    fn refuse(&mut self, error: AmqpError) {
        tracing::debug!(code = error.code.code(), text = %error.text, "refusing AMQP connection");
        self.state = State::Refusing;
        self.close_error = Some(error);
        self.close_started_ms = None;
    }

    /// Closes `channel` with `error` (channel.close) and emits
    /// [`Event::ChannelClosed`]. A hard error code closes the connection
    /// instead, as the spec requires. Does nothing if the channel is not open.
    pub fn channel_error(&mut self, channel: ChannelId, error: AmqpError) {
        if error.code.is_hard() || channel == 0 {
            self.connection_error(error);
            return;
        }
        if !self.can_send(channel) {
            return;
        }
        self.enc.method(
            channel,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: error.code.code(),
                reply_text: error.reply_text().into(),
                class_id: error.class_id,
                method_id: error.method_id,
            })),
        );
        let chan = self.channel_mut(channel);
        chan.state = ChannelState::Closing;
        chan.content = Content::None;
        self.push_event(Event::ChannelClosed {
            channel,
            error: Some(error),
        });
    }

    // ----- answers to events ----------------------------------------------

    /// Accepts the pending login: sends connection.tune.
    pub fn accept_login(&mut self) {
        if self.state != State::Authenticating {
            return;
        }
        self.enc.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Tune(connection::Tune {
                channel_max: self.config.channel_max,
                frame_max: self.config.frame_max,
                heartbeat: self.config.heartbeat_secs,
            })),
        );
        self.state = State::TuneOk;
    }

    /// Refuses the pending login with RabbitMQ's 403 ACCESS_REFUSED:
    /// connection.close if the client announced `authentication_failure_close`;
    /// either way the socket is closed [`Config::silent_close_ms`] later.
    pub fn refuse_login(&mut self) {
        if self.state != State::Authenticating {
            return;
        }
        let mech = self.mechanism.map_or("PLAIN", Mechanism::as_str);
        let e = err(
            ReplyCode::AccessRefused,
            format!(
                "Login was refused using authentication mechanism {mech}. For details see the broker logfile."
            ),
        )
        .with_method(10, 11);
        if self.caps.authentication_failure_close {
            self.send_connection_close(&e);
        }
        self.refuse(e);
    }

    /// Accepts the pending virtual host: sends connection.open-ok.
    pub fn accept_vhost(&mut self) {
        if self.state != State::OpeningVhost {
            return;
        }
        self.enc.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::OpenOk(connection::OpenOk {})),
        );
        self.state = State::Running;
    }

    /// Refuses the pending virtual host with `error` (usually
    /// [`AmqpError::vhost_not_found`] or [`AmqpError::vhost_access_refused`]).
    pub fn refuse_vhost(&mut self, error: AmqpError) {
        if self.state != State::OpeningVhost {
            return;
        }
        self.connection_error(error);
    }

    /// Sends `reply` on `channel`; returns false (and sends nothing) if the
    /// channel is not open, e.g. closed meanwhile.
    pub fn reply(&mut self, channel: ChannelId, reply: Reply) -> bool {
        if !self.can_send(channel) {
            return false;
        }
        self.enc.method(channel, reply.into_class());
        true
    }

    /// Sends a content-carrying method (deliver, get-ok, return) with its
    /// header and body, split into body frames by the negotiated frame_max.
    /// Returns false (and sends nothing) if the channel is not open.
    pub fn send_content(
        &mut self,
        channel: ChannelId,
        method: &ContentMethod<'_>,
        properties: &BasicProperties,
        body: &[u8],
    ) -> bool {
        if !self.can_send(channel) {
            return false;
        }
        self.enc
            .content(channel, method, properties, body, self.frame_max);
        true
    }

    /// Sends a server-initiated basic.cancel for `consumer_tag` (a deleted
    /// queue, a failed mirror), if the client announced
    /// `consumer_cancel_notify`; returns whether it was sent.
    pub fn cancel_consumer(&mut self, channel: ChannelId, consumer_tag: &str) -> bool {
        if !self.caps.consumer_cancel_notify || !self.can_send(channel) {
            return false;
        }
        self.enc.method(
            channel,
            AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                consumer_tag: short(consumer_tag.to_owned()),
                nowait: true,
            })),
        );
        true
    }

    /// While `on`, input stops after each content header or body frame, as
    /// RabbitMQ's reader stops during a resource alarm (the rest stays in
    /// the caller's buffer): a publish that has begun gets no further.
    pub fn hold_publishes(&mut self, on: bool) {
        self.holding = on;
    }

    /// Sends connection.blocked with `reason` if the client announced the
    /// `connection.blocked` capability and is not blocked yet; returns whether sent.
    /// Input is held as [`hold_publishes`](Self::hold_publishes) does,
    /// whether or not the client gets the notification, until
    /// [`unblock`](Self::unblock).
    pub fn block(&mut self, reason: &str) -> bool {
        self.holding = true;
        if !self.caps.connection_blocked || self.blocked || self.state != State::Running {
            return false;
        }
        self.blocked = true;
        self.enc.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Blocked(connection::Blocked {
                reason: short(reason.to_owned()),
            })),
        );
        true
    }

    /// Sends connection.unblocked if connection.blocked was sent; returns whether sent.
    pub fn unblock(&mut self) -> bool {
        self.holding = false;
        if !self.blocked || self.state != State::Running {
            return false;
        }
        self.blocked = false;
        self.enc.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Unblocked(connection::Unblocked {})),
        );
        true
    }

    // ----- time ------------------------------------------------------------

    fn heartbeat_ms(&self) -> Option<u64> {
        let active = matches!(
            self.state,
            State::Open | State::OpeningVhost | State::Running | State::CloseSent
        );
        (active && self.heartbeat_secs > 0).then(|| u64::from(self.heartbeat_secs) * 1000)
    }

    /// The shell is holding this connection's input unread (flow control or
    /// a resource alarm): the client's silence meanwhile is not its fault,
    /// so the missed-heartbeat clock starts again.
    pub fn input_held(&mut self) {
        self.recv_activity = true;
    }

    /// Advances time to `now_ms` (any monotonic millisecond clock): sends a
    /// heartbeat when nothing was sent for half the interval, and ends the
    /// connection when nothing was received for two intervals, the handshake
    /// took too long, or close-ok did not come in time.
    pub fn handle_tick(&mut self, now_ms: u64) {
        if self.state == State::Closed {
            return;
        }
        let started = *self.started_ms.get_or_insert(now_ms);
        if self.state == State::Refusing {
            self.end_after(now_ms, self.config.silent_close_ms, "refused");
            return;
        }
        if !matches!(self.state, State::Running | State::CloseSent)
            && now_ms.saturating_sub(started) >= self.config.handshake_timeout_ms
        {
            self.finish(CloseReason::HandshakeTimeout);
            return;
        }
        if self.state == State::CloseSent
            && self.end_after(now_ms, self.config.close_timeout_ms, "close timed out")
        {
            return;
        }
        let Some(hb) = self.heartbeat_ms() else {
            return;
        };
        if std::mem::take(&mut self.recv_activity) || self.last_recv_ms.is_none() {
            self.last_recv_ms = Some(now_ms);
        }
        if std::mem::take(&mut self.send_activity) || self.last_send_ms.is_none() {
            self.last_send_ms = Some(now_ms);
        }
        let last_recv = self.last_recv_ms.unwrap_or(now_ms);
        if now_ms.saturating_sub(last_recv) >= 2 * hb {
            tracing::debug!(
                heartbeat_secs = self.heartbeat_secs,
                "missed heartbeats from client"
            );
            self.finish(CloseReason::HeartbeatTimeout);
            return;
        }
        let last_send = self.last_send_ms.unwrap_or(now_ms);
        if self.state != State::CloseSent && now_ms.saturating_sub(last_send) >= hb / 2 {
            self.enc.heartbeat();
            self.last_send_ms = Some(now_ms);
        }
    }

    /// Ends the connection with its close error once `after_ms` have passed
    /// since its close began (counted from the first tick after it);
    /// returns whether it ended.
    fn end_after(&mut self, now_ms: u64, after_ms: u64, fallback: &str) -> bool {
        let since = *self.close_started_ms.get_or_insert(now_ms);
        if now_ms.saturating_sub(since) < after_ms {
            return false;
        }
        let e = self
            .close_error
            .take()
            .unwrap_or_else(|| err(ReplyCode::InternalError, fallback));
        self.finish(CloseReason::ServerClosed(e));
        true
    }

    /// The time (same clock as `handle_tick`) by which `handle_tick` must
    /// be called next; `Some(0)` means now, `None` means no timer is needed.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<u64> {
        if self.state == State::Closed {
            return None;
        }
        let Some(started) = self.started_ms else {
            return Some(0);
        };
        if self.state == State::Refusing {
            return Some(
                self.close_started_ms
                    .map_or(0, |t| t + self.config.silent_close_ms),
            );
        }
        let mut deadline = u64::MAX;
        if !matches!(self.state, State::Running | State::CloseSent) {
            deadline = deadline.min(started + self.config.handshake_timeout_ms);
        }
        if self.state == State::CloseSent {
            match self.close_started_ms {
                None => return Some(0),
                Some(t) => deadline = deadline.min(t + self.config.close_timeout_ms),
            }
        }
        if let Some(hb) = self.heartbeat_ms() {
            match (self.last_recv_ms, self.last_send_ms) {
                (Some(r), Some(s)) => {
                    deadline = deadline.min(r + 2 * hb).min(s + hb / 2);
                }
                _ => return Some(0),
            }
        }
        (deadline != u64::MAX).then_some(deadline)
    }
}

/// RabbitMQ's negotiation rule for frame_max and channel_max in tune-ok.
fn negotiate(field: &str, min: u32, server: u32, client: u32) -> Outcome {
    let detail = if client == 0 { " (no limit)" } else { "" };
    let fail = |which: &str, what: &str, limit: u32| {
        Err(Fault::Connection(
            err(
                ReplyCode::NotAllowed,
                format!(
                    "negotiated {field} = {client}{detail} is {which} than the {what} allowed value ({limit})"
                ),
            )
            .with_method(10, 31),
        ))
    };
    if client != 0 && client < min {
        return fail("lower", "minimum", min);
    }
    if server != 0 && (client == 0 || client > server) {
        return fail("higher", "maximum", server);
    }
    Ok(())
}

/// Parses a method payload with `amq-protocol`; also returns basic.qos's
/// prefetch_size, which `amq-protocol` drops.
fn parse_method(payload: &[u8]) -> Result<(AMQPClass, u32), AmqpError> {
    if payload.len() < 4 {
        return Err(err(ReplyCode::FrameError, "method frame too short"));
    }
    let class_id = u16::from_be_bytes([payload[0], payload[1]]);
    let method_id = u16::from_be_bytes([payload[2], payload[3]]);
    if let Err(e) = check_method(payload) {
        return Err(err(
            ReplyCode::SyntaxError,
            format!("method {class_id}.{method_id}: {e}"),
        )
        .with_method(class_id, method_id));
    }
    match parse_class(payload) {
        Ok(([], class)) => {
            let prefetch_size = if (class_id, method_id) == (60, 10) && payload.len() >= 8 {
                u32::from_be_bytes([payload[4], payload[5], payload[6], payload[7]])
            } else {
                0
            };
            Ok((class, prefetch_size))
        }
        Ok(_) => Err(err(
            ReplyCode::SyntaxError,
            format!("trailing bytes after method {class_id}.{method_id}"),
        )
        .with_method(class_id, method_id)),
        Err(_) if !known_method(class_id, method_id) => Err(err(
            ReplyCode::NotImplemented,
            format!("unknown method class {class_id} method {method_id}"),
        )
        .with_method(class_id, method_id)),
        Err(_) => Err(err(
            ReplyCode::FrameError,
            format!("cannot decode method {class_id}.{method_id}"),
        )
        .with_method(class_id, method_id)),
    }
}

/// Whether AMQP 0-9-1 (with RabbitMQ's extensions) defines this method.
fn known_method(class_id: u16, method_id: u16) -> bool {
    let methods: &[u16] = match class_id {
        10 => &[10, 11, 20, 21, 30, 31, 40, 41, 50, 51, 60, 61, 70, 71],
        20 => &[10, 11, 20, 21, 40, 41],
        30 => &[10, 11],
        40 => &[10, 11, 20, 21, 30, 31, 40, 51],
        50 => &[10, 11, 20, 21, 30, 31, 40, 41, 50, 51],
        60 => &[
            10, 11, 20, 21, 30, 31, 40, 50, 60, 70, 71, 72, 80, 90, 100, 110, 111, 120,
        ],
        85 => &[10, 11],
        90 => &[10, 11, 20, 21, 30, 31],
        _ => &[],
    };
    methods.contains(&method_id)
}

fn parse_plain(response: &[u8]) -> Option<(String, String)> {
    let mut parts = response.split(|&b| b == 0);
    let _authzid = parts.next()?;
    let user = parts.next()?;
    let pass = parts.next()?;
    if parts.next().is_some() {
        return None;
    }
    Some((
        String::from_utf8(user.to_vec()).ok()?,
        String::from_utf8(pass.to_vec()).ok()?,
    ))
}

fn parse_amqplain(response: &[u8]) -> Option<(String, String)> {
    // AMQPLAIN sends a field table without its length prefix.
    let len = u32::try_from(response.len()).ok()?;
    let mut table = Vec::with_capacity(response.len() + 4);
    table.extend_from_slice(&len.to_be_bytes());
    table.extend_from_slice(response);
    check_table(&table).ok()?;
    let (rest, table) = parse_field_table(table.as_slice()).ok()?;
    if !rest.is_empty() {
        return None;
    }
    let get = |k: &str| match table.inner().get(k)? {
        AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).ok(),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    };
    Some((get("LOGIN")?, get("PASSWORD")?))
}

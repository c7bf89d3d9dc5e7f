//! An AMQP client inside the node, for the API's message operations
//! (`POST /api/exchanges/{vhost}/{name}/publish`, `POST
//! /api/queues/{vhost}/{name}/get`, `GET /api/aliveness-test/{vhost}`), as
//! RabbitMQ's management plugin uses a direct connection for them.
//!
//! [`Direct`] logs in as the HTTP request's user, with its password, over
//! the broker's own connection machinery (`Broker::connect`,
//! `handle_input`, `take_output`): frames made and parsed by
//! `amq-protocol`, no socket. So permissions, routing, forwarding to a
//! master on another node, confirms and alarms apply as to any client.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use base64::Engine as _;
use serde_json::{Map, Value, json};
use tokio::sync::Notify;
use tokio::time::Instant;
use warren_amqp::amq_protocol::frame::{
    AMQPContentHeader, AMQPFrame, WriteContext, gen_frame, parse_frame,
};
use warren_amqp::amq_protocol::protocol::{
    AMQPClass, BasicProperties, basic, channel, confirm, connection, queue,
};
use warren_amqp::amq_protocol::types::{FieldTable, LongString, ShortString};
use warren_broker::{ConnId, json_to_table, table_to_json};

use crate::Management;
use crate::api::{ApiError, ApiResult};

/// How long one step of the exchange may wait for the broker (a forwarded
/// get, a confirm waiting for every replica's disk).
const STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// The channel every operation uses.
const CH: u16 = 1;

/// The frame_max this client asks for in tune-ok; body frames fill it.
const FRAME_MAX: u32 = 131_072;

/// A message `basic.get` returned.
pub(crate) struct Got {
    /// The delivery tag, to settle it.
    tag: u64,
    redelivered: bool,
    exchange: String,
    routing_key: String,
    /// Messages left in the queue.
    message_count: u32,
    properties: BasicProperties,
    body: Vec<u8>,
}

impl Got {
    /// The message's body.
    pub(crate) fn body(&self) -> &[u8] {
        &self.body
    }
}

/// A logged-in connection with channel 1 open; closed (and gone from the
/// broker) when dropped.
pub(crate) struct Direct {
    s: Management,
    id: ConnId,
    notify: Arc<Notify>,
    /// Bytes for the broker that it has not taken yet (input pauses while a
    /// login or a metadata commit is pending).
    input: bytes::BytesMut,
    /// Bytes from the broker not yet parsed into frames.
    output: bytes::BytesMut,
    open: bool,
}

impl Drop for Direct {
    fn drop(&mut self) {
        let departed = {
            let mut b = self.s.broker();
            let now = b.now_ms();
            b.disconnect(self.id, now)
        };
        // Freed off the broker's lock.
        drop(departed);
    }
}

impl Direct {
    /// Logs in as `user` into `vhost` and opens channel 1.
    pub(crate) async fn open(
        s: &Management,
        user: &str,
        pass: &str,
        vhost: &str,
    ) -> ApiResult<Self> {
        let notify = Arc::new(Notify::new());
        let n = notify.clone();
        let peer = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let id = s.broker().connect(peer, Arc::new(move || n.notify_one()));
        let mut d = Direct {
            s: s.clone(),
            id,
            notify,
            input: bytes::BytesMut::new(),
            output: bytes::BytesMut::new(),
            open: true,
        };
        d.input.extend_from_slice(b"AMQP\x00\x00\x09\x01");
        let mut response = vec![0u8];
        response.extend_from_slice(user.as_bytes());
        response.push(0);
        response.extend_from_slice(pass.as_bytes());
        let mut props = FieldTable::default();
        props.insert(
            "product".into(),
            LongString::from("Warren management API").into(),
        );
        props.insert(
            "connection_name".into(),
            LongString::from("management API").into(),
        );
        d.send(&[
            method(
                0,
                connection_method(connection::AMQPMethod::StartOk(connection::StartOk {
                    client_properties: props,
                    mechanism: "PLAIN".into(),
                    response: LongString::from(response),
                    locale: "en_US".into(),
                })),
            ),
            method(
                0,
                connection_method(connection::AMQPMethod::TuneOk(connection::TuneOk {
                    channel_max: 1,
                    frame_max: FRAME_MAX,
                    heartbeat: 0,
                })),
            ),
            method(
                0,
                connection_method(connection::AMQPMethod::Open(connection::Open {
                    virtual_host: vhost.into(),
                })),
            ),
            method(
                CH,
                AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            ),
        ]);
        loop {
            match d.method().await? {
                AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)) => return Ok(d),
                AMQPClass::Connection(
                    connection::AMQPMethod::Start(_)
                    | connection::AMQPMethod::Tune(_)
                    | connection::AMQPMethod::OpenOk(_),
                ) => {}
                other => return Err(unexpected(&other)),
            }
        }
    }

    /// Publishes with `mandatory` in confirm mode; `Ok(true)` once the
    /// broker confirmed it routed, `Ok(false)` if it came back unroutable.
    pub(crate) async fn publish(
        &mut self,
        exchange: &str,
        routing_key: &str,
        properties: BasicProperties,
        body: &[u8],
    ) -> ApiResult<bool> {
        self.send(&[method(
            CH,
            AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                nowait: false,
            })),
        )]);
        self.expect(|m| matches!(m, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_))))
            .await?;
        let mut frames = vec![
            method(
                CH,
                AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                    exchange: exchange.into(),
                    routing_key: routing_key.into(),
                    mandatory: true,
                    immediate: false,
                })),
            ),
            AMQPFrame::Header(
                CH,
                AMQPContentHeader {
                    class_id: 60,
                    body_size: body.len() as u64,
                    properties,
                },
            ),
        ];
        // Body frames within the frame_max asked for, less the frame's 8 bytes.
        frames.extend(
            body.chunks(FRAME_MAX as usize - 8)
                .map(|c| AMQPFrame::Body(CH, c.to_vec())),
        );
        self.send(&frames);
        let mut routed = true;
        loop {
            match self.frame().await? {
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Return(_))) => {
                    routed = false;
                }
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Ack(_))) => {
                    return Ok(routed);
                }
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Nack(_))) => {
                    return Err(ApiError::internal("the broker refused the message (nack)"));
                }
                // The returned message's header and body.
                AMQPFrame::Header(..) | AMQPFrame::Body(..) => {}
                AMQPFrame::Method(_, m) => return Err(unexpected(&m)),
                _ => {}
            }
        }
    }

    /// `basic.get` (with acks): the next message of `queue`, if any.
    pub(crate) async fn get(&mut self, queue: &str) -> ApiResult<Option<Got>> {
        self.send(&[method(
            CH,
            AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
                queue: queue.into(),
                no_ack: false,
            })),
        )]);
        let ok = loop {
            match self.frame().await? {
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::GetEmpty(_))) => {
                    return Ok(None);
                }
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::GetOk(ok))) => break ok,
                AMQPFrame::Method(_, m) => return Err(unexpected(&m)),
                _ => {}
            }
        };
        let AMQPFrame::Header(_, header) = self.frame().await? else {
            return Err(ApiError::internal("get-ok without a content header"));
        };
        let mut body = Vec::with_capacity(header.body_size.min(1 << 20) as usize);
        while (body.len() as u64) < header.body_size {
            match self.frame().await? {
                AMQPFrame::Body(_, b) => body.extend_from_slice(&b),
                _ => return Err(ApiError::internal("a message's body frames were cut short")),
            }
        }
        Ok(Some(Got {
            tag: ok.delivery_tag,
            redelivered: ok.redelivered,
            exchange: ok.exchange.to_string(),
            routing_key: ok.routing_key.to_string(),
            message_count: ok.message_count,
            properties: header.properties,
            body,
        }))
    }

    /// Acks (`ack`) or rejects, requeued or not, what [`get`](Self::get)
    /// returned; RabbitMQ's ack modes.
    pub(crate) fn settle(&mut self, got: &[Got], ack: bool, requeue: bool) {
        let frames: Vec<AMQPFrame> = got
            .iter()
            .map(|g| {
                let m = if ack {
                    basic::AMQPMethod::Ack(basic::Ack {
                        delivery_tag: g.tag,
                        multiple: false,
                    })
                } else {
                    basic::AMQPMethod::Reject(basic::Reject {
                        delivery_tag: g.tag,
                        requeue,
                    })
                };
                method(CH, AMQPClass::Basic(m))
            })
            .collect();
        self.send(&frames);
    }

    /// `queue.declare` of a non-durable queue (or of one that exists).
    pub(crate) async fn declare(&mut self, name: &str) -> ApiResult<()> {
        self.send(&[method(
            CH,
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: name.into(),
                passive: false,
                durable: false,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        )]);
        self.expect(|m| matches!(m, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_))))
            .await
    }

    /// Closes the connection cleanly, waiting for close-ok.
    pub(crate) async fn close(mut self) {
        self.send(&[method(
            0,
            connection_method(connection::AMQPMethod::Close(connection::Close {
                reply_code: 200,
                reply_text: "done".into(),
                class_id: 0,
                method_id: 0,
            })),
        )]);
        let _ = self
            .expect(|m| matches!(m, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))))
            .await;
    }

    /// Waits for the method `is_it` accepts.
    async fn expect(&mut self, is_it: impl Fn(&AMQPClass) -> bool) -> ApiResult<()> {
        let m = self.method().await?;
        if is_it(&m) {
            Ok(())
        } else {
            Err(unexpected(&m))
        }
    }

    /// The next method frame (anything else before it is skipped).
    async fn method(&mut self) -> ApiResult<AMQPClass> {
        loop {
            if let AMQPFrame::Method(_, m) = self.frame().await? {
                return Ok(m);
            }
        }
    }

    /// Encodes `frames` for the broker, which takes them on the next pump
    /// (input pauses while a login or a metadata commit is pending).
    fn send(&mut self, frames: &[AMQPFrame]) {
        for f in frames {
            // Only frames this module makes, each valid: encoding cannot fail.
            if let Ok(ctx) = gen_frame(f)(WriteContext::from(Vec::new())) {
                self.input.extend_from_slice(&ctx.into_inner().0);
            }
        }
    }

    /// Hands the broker what it can take and takes what it wrote.
    fn pump(&mut self) {
        let mut b = self.s.broker();
        if !self.input.is_empty() && !b.input_paused(self.id) {
            let now = b.now_ms();
            b.handle_input(self.id, &mut self.input, now);
        }
        self.open = b.take_output(self.id, &mut self.output);
    }

    /// The next frame from the broker; a connection or channel error is
    /// the API's error.
    async fn frame(&mut self) -> ApiResult<AMQPFrame> {
        let deadline = Instant::now() + STEP_TIMEOUT;
        loop {
            if let Some(f) = self.parse()? {
                return match f {
                    AMQPFrame::Method(
                        _,
                        AMQPClass::Connection(connection::AMQPMethod::Close(c)),
                    ) => Err(refused(c.reply_code, c.reply_text.as_str())),
                    AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::Close(c))) => {
                        Err(refused(c.reply_code, c.reply_text.as_str()))
                    }
                    f => Ok(f),
                };
            }
            if !self.open {
                return Err(ApiError::internal("the broker closed the connection"));
            }
            self.pump();
            if self.output.is_empty() {
                let notified = self.notify.notified();
                if tokio::time::timeout_at(deadline, notified).await.is_err() {
                    return Err(ApiError::internal("the broker did not answer in time"));
                }
            }
        }
    }

    /// One whole frame off the front of `output`.
    fn parse(&mut self) -> ApiResult<Option<AMQPFrame>> {
        if self.output.len() < 7 {
            return Ok(None);
        }
        let size = u32::from_be_bytes([
            self.output[3],
            self.output[4],
            self.output[5],
            self.output[6],
        ]);
        let total = size as usize + 8;
        if self.output.len() < total {
            return Ok(None);
        }
        let bytes = self.output.split_to(total);
        match parse_frame(&bytes[..]) {
            Ok((_, f)) => Ok(Some(f)),
            Err(e) => Err(ApiError::internal(format!(
                "unparsable frame from the broker: {e}"
            ))),
        }
    }
}

fn method(ch: u16, m: AMQPClass) -> AMQPFrame {
    AMQPFrame::Method(ch, m)
}

fn connection_method(m: connection::AMQPMethod) -> AMQPClass {
    AMQPClass::Connection(m)
}

fn unexpected(m: &AMQPClass) -> ApiError {
    ApiError::internal(format!("unexpected answer from the broker: {m:?}"))
}

/// A broker's connection or channel close as the API's error: 400 with
/// the reply code and text, as RabbitMQ 3.10 answers (a publish to a
/// missing exchange: `404 NOT_FOUND - no exchange 'x' in vhost '/'`).
fn refused(code: u16, text: &str) -> ApiError {
    ApiError::bad_request(format!("{code} {text}"))
}

/// Sets one property of a message.
type Setter = fn(BasicProperties, ShortString) -> BasicProperties;

/// The properties whose value is a short string, with their setters.
const SHORT_PROPERTIES: [(&str, Setter); 9] = [
    ("content_type", BasicProperties::with_content_type),
    ("content_encoding", BasicProperties::with_content_encoding),
    ("correlation_id", BasicProperties::with_correlation_id),
    ("reply_to", BasicProperties::with_reply_to),
    ("expiration", BasicProperties::with_expiration),
    ("message_id", BasicProperties::with_message_id),
    ("type", BasicProperties::with_type),
    ("user_id", BasicProperties::with_user_id),
    ("app_id", BasicProperties::with_app_id),
];

/// A message's properties from the API's JSON (`properties` of a publish).
pub(crate) fn properties_from_json(v: &Value) -> ApiResult<BasicProperties> {
    let Some(o) = v.as_object() else {
        return Ok(BasicProperties::default());
    };
    let mut p = BasicProperties::default();
    for (key, set) in SHORT_PROPERTIES {
        if let Some(s) = o.get(key).and_then(Value::as_str) {
            p = set(p, ShortString::from(s));
        }
    }
    if let Some(h) = o.get("headers").filter(|h| h.is_object()) {
        p = p.with_headers(json_to_table(h));
    }
    if let Some(n) = o.get("delivery_mode") {
        let mode =
            number(n).ok_or_else(|| ApiError::bad_request("delivery_mode must be 1 or 2"))?;
        p = p.with_delivery_mode(u8::try_from(mode).unwrap_or(1));
    }
    if let Some(n) = o.get("priority").and_then(Value::as_u64) {
        p = p.with_priority(u8::try_from(n).unwrap_or(u8::MAX));
    }
    if let Some(n) = o.get("timestamp").and_then(Value::as_u64) {
        p = p.with_timestamp(n);
    }
    Ok(p)
}

/// A number, or a string of one (RabbitMQ's page sends both).
fn number(v: &Value) -> Option<u64> {
    v.as_u64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
}

/// A message's properties as the API shows them (only those set; none is
/// `[]`, as RabbitMQ 3.10 writes an empty property list).
fn properties_json(p: &BasicProperties) -> Value {
    let mut o = Map::new();
    let mut put = |k: &str, v: Option<Value>| {
        if let Some(v) = v {
            o.insert(k.to_owned(), v);
        }
    };
    let s = |x: &Option<ShortString>| x.as_ref().map(|s| Value::from(s.as_str()));
    put("content_type", s(p.content_type()));
    put("content_encoding", s(p.content_encoding()));
    put("headers", p.headers().as_ref().map(table_to_json));
    put("delivery_mode", p.delivery_mode().map(Value::from));
    put("priority", p.priority().map(Value::from));
    put("correlation_id", s(p.correlation_id()));
    put("reply_to", s(p.reply_to()));
    put("expiration", s(p.expiration()));
    put("message_id", s(p.message_id()));
    put("timestamp", p.timestamp().map(Value::from));
    put("type", s(p.kind()));
    put("user_id", s(p.user_id()));
    put("app_id", s(p.app_id()));
    if o.is_empty() {
        return Value::Array(Vec::new());
    }
    Value::Object(o)
}

/// The payload of a publish request: `payload` in `payload_encoding`
/// (`string` or `base64`).
pub(crate) fn payload_from_json(v: &Value) -> ApiResult<Vec<u8>> {
    let payload = v
        .get("payload")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_request("[{key_missing,payload}]"))?;
    match v
        .get("payload_encoding")
        .and_then(Value::as_str)
        .unwrap_or("string")
    {
        "string" => Ok(payload.as_bytes().to_vec()),
        "base64" => base64::engine::general_purpose::STANDARD
            .decode(payload)
            .map_err(|_| ApiError::bad_request("payload is not valid base64")),
        other => Err(ApiError::bad_request(format!(
            "unknown payload_encoding {other}"
        ))),
    }
}

/// A message as `POST …/get` answers: `encoding` `auto` gives the payload
/// as a string when it is UTF-8 (else base64), `base64` always base64;
/// `truncate` cuts the payload to that many bytes.
pub(crate) fn got_json(g: &Got, base64_always: bool, truncate: Option<usize>) -> Value {
    let body = &g.body[..truncate.map_or(g.body.len(), |t| t.min(g.body.len()))];
    let text = (!base64_always)
        .then(|| std::str::from_utf8(body).ok())
        .flatten();
    let (payload, encoding) = match text {
        Some(t) => (t.to_owned(), "string"),
        None => (
            base64::engine::general_purpose::STANDARD.encode(body),
            "base64",
        ),
    };
    json!({
        "payload_bytes": g.body.len(),
        "redelivered": g.redelivered,
        "exchange": g.exchange,
        "routing_key": g.routing_key,
        "message_count": g.message_count,
        "properties": properties_json(&g.properties),
        "payload": payload,
        "payload_encoding": encoding,
    })
}

/// The request body of a get: how many, how to settle them, how to show them.
pub(crate) struct GetRequest {
    /// Messages to get.
    pub(crate) count: usize,
    /// Ack them (`ack_requeue_false`) rather than reject them.
    pub(crate) ack: bool,
    /// Reject with requeue (`ack_requeue_true`, `reject_requeue_true`).
    pub(crate) requeue: bool,
    /// `encoding: base64`.
    pub(crate) base64: bool,
    /// `truncate`, if given.
    pub(crate) truncate: Option<usize>,
}

impl GetRequest {
    /// Reads `{count, ackmode, encoding, truncate}` as RabbitMQ does.
    pub(crate) fn parse(body: &Bytes) -> ApiResult<Self> {
        let v = crate::api::parse_body(body)?;
        let count = v
            .get("count")
            .and_then(|c| {
                c.as_u64()
                    .or_else(|| c.as_str().and_then(|s| s.parse().ok()))
            })
            .ok_or_else(|| ApiError::bad_request("[{key_missing,count}]"))?;
        let (ack, requeue) = match v.get("ackmode").and_then(Value::as_str) {
            Some("ack_requeue_false") => (true, false),
            Some("ack_requeue_true" | "reject_requeue_true") => (false, true),
            Some("reject_requeue_false") => (false, false),
            // 3.x's old boolean form.
            None => (
                false,
                v.get("requeue").and_then(Value::as_bool).unwrap_or(true),
            ),
            Some(other) => return Err(ApiError::bad_request(format!("unknown ackmode {other}"))),
        };
        let base64 = match v.get("encoding").and_then(Value::as_str).unwrap_or("auto") {
            "auto" => false,
            "base64" => true,
            other => return Err(ApiError::bad_request(format!("unknown encoding {other}"))),
        };
        let truncate = v
            .get("truncate")
            .and_then(|t| {
                t.as_u64()
                    .or_else(|| t.as_str().and_then(|s| s.parse().ok()))
            })
            .map(|t| t as usize);
        Ok(Self {
            count: usize::try_from(count).unwrap_or(usize::MAX).min(10_000),
            ack,
            requeue,
            base64,
            truncate,
        })
    }
}

//! A client of a [`Broker`] in the same process: real AMQP 0-9-1 frames,
//! encoded and decoded by `amq-protocol`, fed to [`Broker::handle_input`]
//! and read back from [`Broker::take_output`]. No sockets, no clock: the
//! test sets the time and runs the broker's periodic work ([`Node::tick`])
//! and group commits ([`Node::sync`]) itself.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;

use bytes::BytesMut;
use warren_amqp::amq_protocol::frame::{
    AMQPContentHeader, AMQPFrame, WriteContext, gen_frame, parse_frame,
};
use warren_amqp::amq_protocol::protocol::{
    AMQPClass, BasicProperties, basic, channel, confirm, connection, exchange, queue, tx,
};
use warren_amqp::amq_protocol::types::{AMQPValue, FieldTable};
use warren_backing_queue::Storage;
use warren_broker::meta::{FileStore, MemoryStore, MetadataStore};
use warren_broker::{Broker, BrokerConfig, ConnId};

/// The time the tests start at (ms; any value past zero).
pub const START_MS: u64 = 1_000_000;

struct Inner {
    broker: Broker,
    now: u64,
    _dir: tempfile::TempDir,
}

/// One broker (vhost `/`, user `guest`) with its data in a temporary
/// directory, shared by the [`Client`]s connected to it.
#[derive(Clone)]
pub struct Node(Rc<RefCell<Inner>>);

impl Node {
    /// A fresh broker at [`START_MS`].
    pub fn new() -> Self {
        Self::with_store(Box::new(MemoryStore::default()))
    }

    /// A fresh broker at [`START_MS`] over the metadata store `store`.
    pub fn with_store(store: Box<dyn MetadataStore>) -> Self {
        Self::open_in(tempfile::tempdir().expect("tempdir"), store)
    }

    /// A fresh broker at [`START_MS`] whose queue logs (and journal) are on
    /// `storage`, such as a `MemStorage` whose faults the test turns on.
    pub fn on_storage(storage: Arc<dyn Storage>) -> Self {
        Self::on_storage_with(storage, Box::new(MemoryStore::default()))
    }

    /// [`Node::on_storage`] over the metadata store `store`.
    pub fn on_storage_with(storage: Arc<dyn Storage>, store: Box<dyn MetadataStore>) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = BrokerConfig::new(dir.path());
        cfg.storage = storage;
        Self::open_with(dir, store, cfg)
    }

    /// A fresh broker at [`START_MS`] whose configuration `configure`
    /// changes (its node name, its sibling shards).
    pub fn with_config(configure: impl FnOnce(&mut BrokerConfig)) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = BrokerConfig::new(dir.path());
        configure(&mut cfg);
        Self::open_with(dir, Box::new(MemoryStore::default()), cfg)
    }

    fn open_in(dir: tempfile::TempDir, store: Box<dyn MetadataStore>) -> Self {
        let cfg = BrokerConfig::new(dir.path());
        Self::open_with(dir, store, cfg)
    }

    fn open_with(dir: tempfile::TempDir, store: Box<dyn MetadataStore>, cfg: BrokerConfig) -> Self {
        let mut broker = Broker::open(cfg, store).expect("open broker");
        broker.add_vhost("/").expect("vhost");
        broker.tick(START_MS);
        Self(Rc::new(RefCell::new(Inner {
            broker,
            now: START_MS,
            _dir: dir,
        })))
    }

    /// A fresh broker whose metadata is a file in its directory, so that
    /// [`restart`](Self::restart) finds its queues again.
    pub fn durable() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FileStore::open(dir.path().join("metadata.json")).expect("metadata file");
        Self::open_in(dir, Box::new(store))
    }

    /// Stops the broker of a [`durable`](Self::durable) node (its clients
    /// are gone) and opens it again from its directory, as a node restart.
    pub fn restart(&self) {
        let mut n = self.0.borrow_mut();
        let dir = n._dir.path().to_owned();
        let store = FileStore::open(dir.join("metadata.json")).expect("metadata file");
        n.broker = Broker::open(BrokerConfig::new(&dir), Box::new(store)).expect("reopen broker");
        let now = n.now;
        n.broker.tick(now);
    }

    /// Moves the clock to `now_ms` and runs the broker's tick there
    /// (message and queue expiry).
    pub fn tick(&self, now_ms: u64) {
        let mut n = self.0.borrow_mut();
        n.now = now_ms;
        n.broker.tick(now_ms);
    }

    /// Runs one group commit as the node's sync task does:
    /// `prepare_sync`, `SyncBatch::run`, `complete_sync`.
    pub fn sync(&self) {
        let mut n = self.0.borrow_mut();
        let mut batch = n.broker.prepare_sync();
        batch.run();
        let now = n.now;
        n.broker.complete_sync(batch, now);
    }

    /// Runs `f` on the broker itself (what a shell calls: links, masters).
    pub fn with_broker<R>(&self, f: impl FnOnce(&mut Broker) -> R) -> R {
        f(&mut self.0.borrow_mut().broker)
    }

    /// The names of the queues of vhost `/`.
    pub fn queue_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .0
            .borrow()
            .broker
            .queues(Some("/"))
            .into_iter()
            .map(|q| q.name)
            .collect();
        v.sort();
        v
    }

    /// A fresh broker and a client of it with channel 1 open.
    pub fn session() -> (Self, Client) {
        let node = Self::new();
        let mut c = node.connect();
        c.open_channel(1);
        (node, c)
    }

    /// The client's socket is gone ([`Broker::disconnect`]).
    pub fn disconnect(&self, c: &Client) {
        let mut n = self.0.borrow_mut();
        let now = n.now;
        drop(n.broker.disconnect(c.id, now));
    }

    /// A client logged in as `guest` from loopback, on vhost `/`.
    pub fn connect(&self) -> Client {
        let peer: SocketAddr = "127.0.0.1:40000".parse().expect("addr");
        let id = self.0.borrow_mut().broker.connect(peer, Arc::new(|| {}));
        let mut c = Client {
            node: self.clone(),
            id,
            input: BytesMut::new(),
            inbox: VecDeque::new(),
        };
        c.handshake();
        c
    }
}

/// A method the client received, with its message if it carries one
/// (basic.deliver, basic.get-ok, basic.return).
#[derive(Debug, Clone)]
pub struct Incoming {
    /// Its channel.
    pub channel: u16,
    /// The method.
    pub method: AMQPClass,
    /// The message's properties (content-bearing methods only).
    pub properties: Option<BasicProperties>,
    /// The message's body (content-bearing methods only).
    pub body: Vec<u8>,
}

impl Incoming {
    /// The method's `(class, method)` ids.
    pub fn ids(&self) -> (u16, u16) {
        (
            self.method.get_amqp_class_id(),
            self.method.get_amqp_method_id(),
        )
    }

    /// The message's headers (empty without).
    pub fn headers(&self) -> FieldTable {
        self.properties
            .as_ref()
            .and_then(|p| p.headers().clone())
            .unwrap_or_default()
    }
}

/// A channel or connection closed by the server: RabbitMQ's reply code,
/// text and the method that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Closed {
    /// Whether the whole connection closed (else one channel).
    pub connection: bool,
    /// The reply code (404, 406, …).
    pub code: u16,
    /// The reply text (`NOT_FOUND - no queue 'q' in vhost '/'`).
    pub text: String,
    /// The failed method's class id.
    pub class_id: u16,
    /// The failed method's method id.
    pub method_id: u16,
}

/// A connection to a [`Node`], driven frame by frame.
pub struct Client {
    node: Node,
    id: ConnId,
    /// Server bytes not yet parsed (a frame cut by a write boundary).
    input: BytesMut,
    inbox: VecDeque<Incoming>,
}

/// Encodes one frame.
fn encode(f: &AMQPFrame) -> Vec<u8> {
    gen_frame(f)(WriteContext::from(Vec::new()))
        .expect("encode frame")
        .into_inner()
        .0
}

/// The channel or connection close that `inc` is, if it is one.
fn closed(inc: &Incoming) -> Option<Closed> {
    match &inc.method {
        AMQPClass::Channel(channel::AMQPMethod::Close(c)) => Some(Closed {
            connection: false,
            code: c.reply_code,
            text: c.reply_text.to_string(),
            class_id: c.class_id,
            method_id: c.method_id,
        }),
        AMQPClass::Connection(connection::AMQPMethod::Close(c)) => Some(Closed {
            connection: true,
            code: c.reply_code,
            text: c.reply_text.to_string(),
            class_id: c.class_id,
            method_id: c.method_id,
        }),
        _ => None,
    }
}

impl Client {
    /// The sibling shard this connection asks to move to, if it does
    /// ([`Broker::moving`]).
    pub fn moving(&self) -> Option<String> {
        self.node
            .0
            .borrow()
            .broker
            .moving(self.id)
            .map(|s| s.to_string())
    }

    /// Lets the broker move this connection ([`Broker::may_move`]).
    pub fn allow_moving(&mut self) {
        self.node.0.borrow_mut().broker.may_move(self.id);
    }

    /// Moves this connection to `to`, as the shell does when it asks to:
    /// out of its broker ([`Broker::detach`]) and into `to`'s
    /// ([`Broker::attach`]), then reads what it has there.
    pub fn move_to(&mut self, to: &Node) {
        let m = self
            .node
            .0
            .borrow_mut()
            .broker
            .detach(self.id)
            .expect("the connection asked to move");
        {
            let mut n = to.0.borrow_mut();
            let now = n.now;
            self.id = n.broker.attach(m, Arc::new(|| {}), now);
        }
        self.node = to.clone();
        self.pump();
    }

    /// Feeds raw bytes to the broker as if read from the socket, then
    /// reads whatever the broker has for this connection.
    pub fn send_bytes(&mut self, bytes: &[u8]) {
        {
            let mut n = self.node.0.borrow_mut();
            let now = n.now;
            let mut buf = BytesMut::from(bytes);
            n.broker.handle_input(self.id, &mut buf, now);
            assert!(buf.is_empty(), "the broker left input unread");
        }
        self.pump();
    }

    /// Whether the broker holds this connection's input back (flow
    /// control, [`Broker::input_paused`]): its shell would read no more.
    pub fn input_paused(&self) -> bool {
        self.node.0.borrow().broker.input_paused(self.id)
    }

    /// Sends one method on channel `ch`.
    pub fn send(&mut self, ch: u16, method: AMQPClass) {
        self.send_bytes(&encode(&AMQPFrame::Method(ch, method)));
    }

    /// Takes the broker's pending output for this connection into the inbox
    /// (what another connection's work, a tick or a group commit left).
    pub fn pump(&mut self) {
        let mut out = BytesMut::new();
        self.node
            .0
            .borrow_mut()
            .broker
            .take_output(self.id, &mut out);
        self.input.extend_from_slice(&out);
        let mut content: Option<(Incoming, u64)> = None;
        while let Ok((rest, frame)) = parse_frame(&self.input[..]) {
            let used = self.input.len() - rest.len();
            let _ = self.input.split_to(used);
            match frame {
                AMQPFrame::Method(channel, method) => {
                    assert!(content.is_none(), "a method inside a message");
                    let carries = matches!(
                        method,
                        AMQPClass::Basic(
                            basic::AMQPMethod::Deliver(_)
                                | basic::AMQPMethod::GetOk(_)
                                | basic::AMQPMethod::Return(_)
                        )
                    );
                    let inc = Incoming {
                        channel,
                        method,
                        properties: None,
                        body: Vec::new(),
                    };
                    if carries {
                        content = Some((inc, 0));
                    } else {
                        self.received(inc);
                    }
                }
                AMQPFrame::Header(_, h) => {
                    let (inc, size) = content.as_mut().expect("a header without a method");
                    inc.properties = Some(h.properties);
                    *size = h.body_size;
                    if *size == 0 {
                        let (inc, _) = content.take().expect("content");
                        self.received(inc);
                    }
                }
                AMQPFrame::Body(_, data) => {
                    let (inc, size) = content.as_mut().expect("a body without a method");
                    inc.body.extend_from_slice(&data);
                    if inc.body.len() as u64 >= *size {
                        let (inc, _) = content.take().expect("content");
                        self.received(inc);
                    }
                }
                AMQPFrame::Heartbeat
                | AMQPFrame::InvalidHeartbeat(_)
                | AMQPFrame::ProtocolHeader(_) => {}
            }
        }
        assert!(content.is_none(), "a message cut short");
    }

    fn received(&mut self, inc: Incoming) {
        // A channel closed by the server is confirmed at once, as clients
        // do, so that the test may open it again.
        if let AMQPClass::Channel(channel::AMQPMethod::Close(_)) = &inc.method {
            let ok = encode(&AMQPFrame::Method(
                inc.channel,
                AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
            ));
            self.inbox.push_back(inc);
            let mut n = self.node.0.borrow_mut();
            let now = n.now;
            n.broker
                .handle_input(self.id, &mut BytesMut::from(&ok[..]), now);
            return;
        }
        self.inbox.push_back(inc);
    }

    /// Everything received and not yet taken.
    pub fn drain(&mut self) -> Vec<Incoming> {
        self.pump();
        self.inbox.drain(..).collect()
    }

    /// The next method received (panics if there is none).
    pub fn recv(&mut self) -> Incoming {
        self.pump();
        self.inbox.pop_front().expect("the broker sent nothing")
    }

    /// The next method received on channel `ch` or on channel 0 (panics if
    /// there is none); what came on other channels stays in the inbox.
    pub fn recv_on(&mut self, ch: u16) -> Incoming {
        self.pump();
        let at = self
            .inbox
            .iter()
            .position(|i| i.channel == ch || i.channel == 0)
            .unwrap_or_else(|| panic!("nothing on channel {ch}: {:?}", self.inbox));
        self.inbox.remove(at).expect("present")
    }

    /// Sends `method` on `ch` and returns the answer: the next method on
    /// that channel (or channel 0), or how the server closed it.
    pub fn call(&mut self, ch: u16, method: AMQPClass) -> Result<Incoming, Closed> {
        self.send(ch, method);
        let inc = self.recv_on(ch);
        match closed(&inc) {
            Some(c) => Err(c),
            None => Ok(inc),
        }
    }

    /// Sends `method` on `ch`: the answer, which must have the `(class,
    /// method)` ids `want` unless the server closed the channel.
    pub fn call_for(
        &mut self,
        ch: u16,
        method: AMQPClass,
        want: (u16, u16),
    ) -> Result<Incoming, Closed> {
        let inc = self.call(ch, method)?;
        assert_eq!(inc.ids(), want, "expected {want:?}, got {inc:?}");
        Ok(inc)
    }

    /// Sends `method` on `ch`, which must be answered by `(class, method)`
    /// ids `want` (`what` names that answer in the panic message).
    pub fn call_ok(
        &mut self,
        ch: u16,
        method: AMQPClass,
        want: (u16, u16),
        what: &str,
    ) -> Incoming {
        self.call_for(ch, method, want)
            .unwrap_or_else(|e| panic!("expected {what}, got {e:?}"))
    }

    /// The close that the server sent next on channel `ch` (or on the
    /// connection); panics on anything else.
    pub fn expect_close(&mut self, ch: u16) -> Closed {
        let inc = self.recv_on(ch);
        closed(&inc).unwrap_or_else(|| panic!("expected a close, got {inc:?}"))
    }

    fn handshake(&mut self) {
        self.send_bytes(b"AMQP\x00\x00\x09\x01");
        let start = self.recv();
        assert_eq!(start.ids(), (10, 10), "connection.start: {start:?}");
        self.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: FieldTable::default(),
                mechanism: "PLAIN".into(),
                response: "\0guest\0guest".into(),
                locale: "en_US".into(),
            })),
        );
        let tune = self.recv();
        let AMQPClass::Connection(connection::AMQPMethod::Tune(t)) = tune.method else {
            panic!("expected connection.tune, got {tune:?}");
        };
        self.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: t.channel_max,
                frame_max: t.frame_max,
                heartbeat: 0,
            })),
        );
        self.call_ok(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: "/".into(),
            })),
            (10, 41),
            "connection.open-ok",
        );
    }

    /// Opens channel `ch`.
    pub fn open_channel(&mut self, ch: u16) {
        self.call_ok(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            (20, 11),
            "channel.open-ok",
        );
    }

    /// channel.close from the client (200); returns once closed.
    pub fn close_channel(&mut self, ch: u16) {
        self.call_ok(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: 200,
                reply_text: "".into(),
                class_id: 0,
                method_id: 0,
            })),
            (20, 41),
            "channel.close-ok",
        );
    }

    /// queue.declare; returns `(queue, message_count, consumer_count)` of
    /// the declare-ok.
    pub fn declare_queue(
        &mut self,
        ch: u16,
        name: &str,
        opts: QueueOpts,
    ) -> Result<(String, u32, u32), Closed> {
        let inc = self.call(
            ch,
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: name.into(),
                passive: opts.passive,
                durable: opts.durable,
                exclusive: opts.exclusive,
                auto_delete: opts.auto_delete,
                nowait: false,
                arguments: opts.arguments,
            })),
        )?;
        let AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) = inc.method else {
            panic!("expected queue.declare-ok, got {inc:?}");
        };
        Ok((ok.queue.to_string(), ok.message_count, ok.consumer_count))
    }

    /// The `(message_count, consumer_count)` of queue `name` (a passive
    /// declare on channel `ch`, which must succeed).
    pub fn counts(&mut self, ch: u16, name: &str) -> (u32, u32) {
        let (_, messages, consumers) = self
            .declare_queue(ch, name, QueueOpts::passive())
            .expect("passive queue.declare");
        (messages, consumers)
    }

    /// A plain (transient, not exclusive) queue.declare that must succeed.
    pub fn queue(&mut self, ch: u16, name: &str) {
        self.declare_queue(ch, name, QueueOpts::default())
            .expect("queue.declare");
    }

    /// exchange.declare of type `kind`.
    pub fn declare_exchange(
        &mut self,
        ch: u16,
        name: &str,
        kind: &str,
        durable: bool,
        arguments: FieldTable,
    ) -> Result<(), Closed> {
        self.call_for(
            ch,
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
                exchange: name.into(),
                kind: kind.into(),
                passive: false,
                durable,
                auto_delete: false,
                internal: false,
                nowait: false,
                arguments,
            })),
            (40, 11),
        )
        .map(drop)
    }

    /// queue.bind.
    pub fn bind(
        &mut self,
        ch: u16,
        queue_name: &str,
        exchange: &str,
        key: &str,
        arguments: FieldTable,
    ) -> Result<(), Closed> {
        self.call_for(
            ch,
            AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
                queue: queue_name.into(),
                exchange: exchange.into(),
                routing_key: key.into(),
                nowait: false,
                arguments,
            })),
            (50, 21),
        )
        .map(drop)
    }

    /// basic.publish with its content; what the broker answers stays in
    /// the inbox.
    pub fn publish(&mut self, ch: u16, exchange: &str, key: &str, msg: Message) {
        let mut bytes = encode(&AMQPFrame::Method(
            ch,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: exchange.into(),
                routing_key: key.into(),
                mandatory: msg.mandatory,
                immediate: false,
            })),
        ));
        bytes.extend(encode(&AMQPFrame::Header(
            ch,
            AMQPContentHeader {
                class_id: 60,
                body_size: msg.body.len() as u64,
                properties: msg.properties,
            },
        )));
        if !msg.body.is_empty() {
            bytes.extend(encode(&AMQPFrame::Body(ch, msg.body)));
        }
        self.send_bytes(&bytes);
    }

    /// basic.qos (per consumer unless `global`).
    pub fn qos(&mut self, ch: u16, prefetch_count: u16, global: bool) {
        self.call_ok(
            ch,
            AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
                prefetch_count,
                global,
            })),
            (60, 11),
            "basic.qos-ok",
        );
    }

    /// basic.consume; returns the consume-ok. Deliveries that follow it at
    /// once stay in the inbox.
    pub fn consume(&mut self, ch: u16, queue_name: &str, tag: &str, no_ack: bool) -> Incoming {
        self.call_ok(
            ch,
            consume_method(queue_name, tag, no_ack),
            (60, 21),
            "basic.consume-ok",
        )
    }

    /// basic.get: the get-ok with its message, or the get-empty.
    pub fn get(&mut self, ch: u16, queue_name: &str, no_ack: bool) -> Result<Incoming, Closed> {
        self.call(
            ch,
            AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
                queue: queue_name.into(),
                no_ack,
            })),
        )
    }

    /// The body of the next message of `queue_name` (basic.get, no-ack),
    /// `None` if it is empty.
    pub fn get_body(&mut self, ch: u16, queue_name: &str) -> Option<Vec<u8>> {
        let inc = self.get(ch, queue_name, true).expect("basic.get");
        match inc.method {
            AMQPClass::Basic(basic::AMQPMethod::GetOk(_)) => Some(inc.body),
            AMQPClass::Basic(basic::AMQPMethod::GetEmpty(_)) => None,
            _ => panic!("expected get-ok or get-empty, got {inc:?}"),
        }
    }

    /// Every message body `queue_name` holds, taken with basic.get.
    pub fn get_all(&mut self, ch: u16, queue_name: &str) -> Vec<Vec<u8>> {
        std::iter::from_fn(|| self.get_body(ch, queue_name)).collect()
    }

    /// basic.ack (no answer expected).
    pub fn ack(&mut self, ch: u16, delivery_tag: u64, multiple: bool) {
        self.send(
            ch,
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag,
                multiple,
            })),
        );
    }

    /// basic.reject (no answer expected).
    pub fn reject(&mut self, ch: u16, delivery_tag: u64, requeue: bool) {
        self.send(
            ch,
            AMQPClass::Basic(basic::AMQPMethod::Reject(basic::Reject {
                delivery_tag,
                requeue,
            })),
        );
    }

    /// confirm.select.
    pub fn confirm_select(&mut self, ch: u16) {
        self.call_ok(
            ch,
            AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                nowait: false,
            })),
            (85, 11),
            "confirm.select-ok",
        );
    }

    /// tx.select, tx.commit or tx.rollback (`method` 10, 20 or 30): sends
    /// it; the answer stays in the inbox.
    pub fn tx(&mut self, ch: u16, method: u16) {
        let m = match method {
            10 => tx::AMQPMethod::Select(tx::Select {}),
            20 => tx::AMQPMethod::Commit(tx::Commit {}),
            30 => tx::AMQPMethod::Rollback(tx::Rollback {}),
            _ => panic!("no tx method {method}"),
        };
        self.send(ch, AMQPClass::Tx(m));
    }
}

/// The settings of a queue.declare.
#[derive(Debug, Clone, Default)]
pub struct QueueOpts {
    /// Only check that it exists.
    pub passive: bool,
    /// Survives a restart.
    pub durable: bool,
    /// Owned by the declaring connection.
    pub exclusive: bool,
    /// Deleted when its last consumer goes.
    pub auto_delete: bool,
    /// `x-…` arguments.
    pub arguments: FieldTable,
}

impl QueueOpts {
    /// A durable queue.
    pub fn durable() -> Self {
        Self {
            durable: true,
            ..Self::default()
        }
    }

    /// Deleted when its last consumer goes.
    pub fn auto_delete() -> Self {
        Self {
            auto_delete: true,
            ..Self::default()
        }
    }

    /// A passive declare.
    pub fn passive() -> Self {
        Self {
            passive: true,
            ..Self::default()
        }
    }

    /// With argument `key` = `value`.
    pub fn arg(mut self, key: &str, value: AMQPValue) -> Self {
        self.arguments.insert(key.into(), value);
        self
    }
}

/// A message to publish.
#[derive(Debug, Clone, Default)]
pub struct Message {
    /// Its properties.
    pub properties: BasicProperties,
    /// Its body.
    pub body: Vec<u8>,
    /// Returned (312 NO_ROUTE) if no queue takes it.
    pub mandatory: bool,
}

impl Message {
    /// A transient message with `body`.
    pub fn new(body: &str) -> Self {
        Self {
            body: body.as_bytes().to_vec(),
            ..Self::default()
        }
    }

    /// A persistent message (delivery mode 2) with `body`.
    pub fn persistent(body: &str) -> Self {
        let mut m = Self::new(body);
        m.properties = m.properties.with_delivery_mode(2);
        m
    }

    /// Returned if unroutable.
    pub fn mandatory(mut self) -> Self {
        self.mandatory = true;
        self
    }

    /// With headers.
    pub fn headers(mut self, headers: FieldTable) -> Self {
        self.properties = self.properties.with_headers(headers);
        self
    }

    /// With a per-message TTL (`expiration`, ms).
    pub fn expiration(mut self, ms: u64) -> Self {
        self.properties = self.properties.with_expiration(ms.to_string().into());
        self
    }
}

/// A field table from `(key, value)` pairs.
pub fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert((*k).into(), v.clone());
    }
    t
}

/// A long-string field value.
pub fn s(v: &str) -> AMQPValue {
    AMQPValue::LongString(v.into())
}

/// A basic.consume (not exclusive, no arguments).
pub fn consume_method(queue_name: &str, tag: &str, no_ack: bool) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
        queue: queue_name.into(),
        consumer_tag: tag.into(),
        no_local: false,
        no_ack,
        exclusive: false,
        nowait: false,
        arguments: FieldTable::default(),
    }))
}

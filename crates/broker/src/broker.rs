//! The broker: vhosts, exchanges, queues, connections and channels, driven
//! by the AMQP connection state machines it owns.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use rand::RngCore as _;
use sha2::{Digest as _, Sha256};
use warren_amqp::amq_protocol::protocol::{basic, exchange, queue};
use warren_amqp::amq_protocol::types::{AMQPValue, FieldArray, FieldTable, ShortString};
use warren_amqp::{
    AmqpError, BasicProperties, ChannelId, Command, Config, Connection, ContentMethod, Credentials,
    Event, Publish, Reply, ReplyCode,
};
use warren_backing_queue::{
    BackingQueue, DropReason, Dropped, FsStorage, Limits, NewMessage, QueueConfig, SeqId, Storage,
    StoreConfig, SyncJob,
};
use warren_policy::MasterLocator;

use crate::BrokerError;
use crate::auth::{self, Access, Permission, PermissionDef, UserDef};
use crate::meta::{BindingDef, Change, ExchangeDef, MetadataStore, QueueDef};
use crate::names::{BadName, MAX_NAME_BYTES, check_name, shown};
use crate::routing::{self, Kind, as_i64, as_str, decode_meta, encode_meta, type_name};

#[path = "alarm.rs"]
pub(crate) mod alarm;
#[path = "introspect.rs"]
pub(crate) mod introspect;
#[path = "link.rs"]
pub(crate) mod link;
#[path = "mirrored.rs"]
pub(crate) mod mirrored;
#[path = "policies.rs"]
pub(crate) mod policies;
#[path = "stats.rs"]
pub(crate) mod stats;
use link::Elsewhere;

use mirrored::{FetchForArgs, Store, nack_one};

/// Identifies one client connection.
pub type ConnId = u64;

/// FxHash-style hasher for the server-chosen integer keys (connection and
/// channel ids): hashed on every message, and never chosen by clients to
/// collide.
#[derive(Debug, Default, Clone, Copy)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u16(&mut self, n: u16) {
        self.write_u64(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

type IdMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<IdHasher>>;

/// Called (under the broker's lock) to wake a task: the connection's task
/// when it has output to write, the sync task when a group commit is due.
pub type Waker = Arc<dyn Fn() + Send + Sync>;

/// Output past which a consumer connection gets no more deliveries until
/// its task has written what it has.
const OUTPUT_HIGH_WATER: usize = 4 << 20;
/// The confirm sequence number that marks a publish of a tx.commit (a
/// transactional channel is never in confirm mode).
const TX_COMMIT: u64 = u64::MAX;
/// Fetches from a mirrored queue one consumer may wait for at once: the
/// fetches share the ring with up to 4,000 publishes (the flow-control
/// backlog, `mirrored::BACKLOG_HIGH`), so fewer
/// starve a consumer behind a fast publisher.
const MAX_FETCHES_IN_FLIGHT: u32 = 4096;

/// A queue whose consumers took a message within [`FLOW_ACTIVE_MS`] holds
/// back its publishers while more than this many messages are ready, so
/// that consumers keep pace with what is accepted (RabbitMQ's credit flow
/// has the same effect). Idle consumers hold nobody back: the queue then
/// grows as RabbitMQ's does.
const FLOW_READY_MAX: u64 = 8_192;
/// See [`FLOW_READY_MAX`].
const FLOW_ACTIVE_MS: u64 = 1_000;
/// Queues remembered per publishing connection for flow control.
const FLOW_TARGETS: usize = 8;
/// How deep dead-lettering may chain within one operation.
const DEAD_LETTER_DEPTH: u8 = 8;

/// Settings of a broker.
#[derive(Debug, Clone)]
pub struct BrokerConfig {
    /// Where durable queues keep their logs (`<data_dir>/queues/…`).
    pub data_dir: PathBuf,
    /// The node's name (shown to clients as `cluster_name`).
    pub node_name: String,
    /// Settings of every client connection.
    pub amqp: Config,
    /// Where durable queues' logs are written: the file system, or a
    /// `MemStorage` in simulations that inject storage faults.
    pub storage: Arc<dyn Storage>,
}

impl BrokerConfig {
    /// Defaults for a node keeping its data in `data_dir`.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            node_name: "warren@localhost".into(),
            amqp: Config::default(),
            storage: FsStorage::shared(),
        }
    }
}

/// Counts shown by the management overview.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overview {
    /// Open client connections (not the forwarding links of other nodes).
    pub connections: u64,
    /// Their open channels.
    pub channels: u64,
    /// Queues in all vhosts.
    pub queues: u64,
    /// Exchanges in all vhosts.
    pub exchanges: u64,
    /// Consumers of this node's client connections (not those another
    /// node forwards here).
    pub consumers: u64,
    /// Ready messages in all queues.
    pub messages_ready: u64,
    /// Messages delivered and not yet acked.
    pub messages_unacknowledged: u64,
}

#[derive(Debug, Clone, PartialEq)]
enum Dest {
    Queue(Arc<str>),
    Exchange(String),
}

#[derive(Debug, Clone)]
struct Binding {
    dest: Dest,
    key: String,
    args: FieldTable,
}

#[derive(Debug)]
struct Exchange {
    kind: Kind,
    durable: bool,
    auto_delete: bool,
    internal: bool,
    arguments: FieldTable,
    bindings: Vec<Binding>,
}

#[derive(Debug, Clone)]
struct Consumer {
    tag: Arc<str>,
    conn: ConnId,
    channel: ChannelId,
    no_ack: bool,
    exclusive: bool,
    prefetch: u16,
    unacked: u32,
    /// Fetches from a mirrored queue's replica not yet handed out.
    reserved: u32,
    /// Its id at the queue's master when the queue is forwarded (0: none).
    remote_cid: u64,
    /// `x-cancel-on-ha-failover`: cancelled when the queue's master changes.
    cancel_on_failover: bool,
}

#[derive(Debug, Clone, PartialEq)]
struct QueueOpts {
    durable: bool,
    exclusive: bool,
    auto_delete: bool,
    arguments: FieldTable,
}

struct Queue {
    name: Arc<str>,
    uid: u64,
    opts: QueueOpts,
    owner: Option<ConnId>,
    store: Store,
    /// Where this queue is served when not on this node (forwarded).
    remote: Option<Elsewhere>,
    /// This node's master replica handed the queue over: it is not served
    /// here until this node is made its master again.
    handed_over: bool,
    consumers: Vec<Consumer>,
    rr: usize,
    had_consumers: bool,
    dlx: Option<String>,
    dlrk: Option<String>,
    expires_ms: Option<u64>,
    /// `x-overflow: reject-publish[-dlx]`.
    reject: Option<RejectPublish>,
    /// The limits last given to the store (arguments and policy).
    limits: Limits,
    /// `x-max-priority`: a priority queue (an argument only, fixed at declare).
    max_priority: Option<u8>,
    /// When it last handed a message to a consumer (flow control: a queue
    /// whose consumers are taking messages holds its publishers back while
    /// its backlog is large).
    delivered_at_ms: u64,
    last_used_ms: u64,
    /// Metadata and body of each message, kept only when dead-lettering is on.
    dl_msgs: HashMap<u64, (Bytes, Bytes)>,
    /// Publishes waiting for a group commit before they are confirmed:
    /// (queue seq, connection, channel, publish sequence number).
    confirms: VecDeque<(SeqId, ConnId, ChannelId, u64)>,
    dir: Option<PathBuf>,
    /// Its traffic since this node started serving it.
    counters: stats::QueueCounters,
    /// Its master's figures, when it is served on another node (asked for
    /// every second: `peek_masters`).
    remote_figures: Option<link::QueueFigures>,
}

impl Queue {
    /// This node's figures of the queue: its store's counts, its consumers here.
    fn figures(&self) -> link::QueueFigures {
        let s = self.store.stats();
        link::QueueFigures {
            ready: s.ready,
            unacked: s.unacked,
            ready_bytes: s.ready_bytes,
            unacked_bytes: s.unacked_bytes,
            consumers: self.consumers.len() as u64,
        }
    }

    /// A message of this queue (in `vhost`) to dead-letter for `reason`;
    /// `None` without a dead-letter exchange.
    fn dead_letter(
        &self,
        vhost: &str,
        reason: DropReason,
        meta: Bytes,
        body: Bytes,
    ) -> Option<DeadLetter> {
        Some(DeadLetter {
            vhost: vhost.to_owned(),
            exchange: self.dlx.clone()?,
            routing_key: self.dlrk.clone(),
            queue: self.name.clone(),
            reason,
            meta,
            body,
        })
    }
}

impl fmt::Debug for Queue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Queue")
            .field("name", &self.name)
            .field("opts", &self.opts)
            .field("consumers", &self.consumers.len())
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
struct Vhost {
    exchanges: HashMap<String, Exchange>,
    queues: HashMap<Arc<str>, Queue>,
    permissions: HashMap<String, PermissionDef>,
}

#[derive(Debug, Clone)]
struct Unacked {
    queue: Arc<str>,
    bq_tag: u64,
    consumer: Option<Arc<str>>,
    msg_id: u64,
    /// Where to settle a delivery from a forwarded queue.
    remote: Option<Elsewhere>,
}

#[derive(Debug)]
enum TxOp {
    Publish(Box<Publish>),
    Ack(basic::Ack),
    Nack(basic::Nack),
    Reject(basic::Reject),
}

#[derive(Debug, Default)]
struct Channel {
    next_tag: u64,
    unacked: BTreeMap<u64, Unacked>,
    consumers: HashMap<Arc<str>, Arc<str>>,
    prefetch: u16,
    global_prefetch: u16,
    confirm: bool,
    confirm_pending: BTreeMap<u64, u32>,
    /// Publishes refused (`basic.nack`) not yet sent.
    confirm_nacked: BTreeSet<u64>,
    confirm_last: u64,
    /// Every publish up to here has been acked or nacked (`multiple`).
    confirm_acked: u64,
    /// Publishes confirmed since the last flush, in no order.
    confirm_done: Vec<u64>,
    /// When each confirm-mode publish not yet settled was read: sequence
    /// number to ms.
    confirm_started: BTreeMap<u64, u64>,
    tx: Option<Vec<TxOp>>,
    /// Group commits a tx.commit-ok waits for.
    tx_wait: u32,
    last_queue: Option<String>,
    /// Its client traffic so far (`/api/channels`).
    counters: stats::MessageCounters,
}

struct Conn {
    amqp: Connection,
    peer: SocketAddr,
    user: String,
    vhost: String,
    perm: Option<Permission>,
    channels: IdMap<ChannelId, Channel>,
    waker: Waker,
    woken: bool,
    out_pending: usize,
    throttled: bool,
    confirm_dirty: Vec<ChannelId>,
    closed: bool,
    /// Set for the internal connection of a forwarding link (master side).
    link: Option<link::Link>,
    /// It has begun to publish (a basic.publish method arrived): flow
    /// control and resource alarms may hold its input back.
    publisher: bool,
    /// Its client traffic so far.
    counters: stats::MessageCounters,
    /// Its confirm latencies so far.
    latency: stats::LatencyHistogram,
    /// Bytes read from and written to its socket.
    octets: stats::Octets,
    /// The queues (of its vhost) this connection's publishes went to lately:
    /// it waits while one of them lags behind its consumers (flow control).
    targets: Vec<Arc<str>>,
}

/// A client connection that has left the broker, with everything it owned.
/// Dropping it may free much memory (unfinished messages): drop it after the
/// broker's lock is released.
pub struct Departed(Box<Conn>);

impl fmt::Debug for Departed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Departed").field(&self.0).finish()
    }
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Conn")
            .field("peer", &self.peer)
            .field("user", &self.user)
            .field("vhost", &self.vhost)
            .finish_non_exhaustive()
    }
}

impl Conn {
    fn wake(&mut self, current: ConnId, me: ConnId) {
        if self.link.is_some() {
            // A link's shell takes output from every link at once.
            (self.waker)();
        } else if me != current && !self.woken {
            self.woken = true;
            (self.waker)();
        }
    }

    /// Sends the acks and nacks of publishes settled since the last call;
    /// `now_ms` times the confirms.
    fn flush_confirms(&mut self, now_ms: u64) {
        for ch_id in std::mem::take(&mut self.confirm_dirty) {
            let Some(ch) = self.channels.get_mut(&ch_id) else {
                continue;
            };
            let upto = match ch.confirm_pending.first_key_value() {
                Some((k, _)) => k - 1,
                None => ch.confirm_last,
            };
            while let Some(&n) = ch.confirm_nacked.first() {
                if n > upto {
                    break;
                }
                ch.confirm_nacked.pop_first();
                if n > ch.confirm_acked + 1 {
                    self.amqp.reply(
                        ch_id,
                        Reply::Ack {
                            delivery_tag: n - 1,
                            multiple: true,
                        },
                    );
                }
                self.amqp.reply(
                    ch_id,
                    Reply::Nack {
                        delivery_tag: n,
                        multiple: false,
                    },
                );
                ch.confirm_acked = n;
            }
            if upto > ch.confirm_acked {
                ch.confirm_acked = upto;
                self.amqp.reply(
                    ch_id,
                    Reply::Ack {
                        delivery_tag: upto,
                        multiple: true,
                    },
                );
            }
            while let Some(entry) = ch.confirm_started.first_entry() {
                if *entry.key() > ch.confirm_acked {
                    break;
                }
                let at = entry.remove();
                self.counters.confirmed += 1;
                ch.counters.confirmed += 1;
                self.latency.observe(now_ms.saturating_sub(at));
            }
            // Confirmed behind one still pending: acked one by one now, as
            // RabbitMQ does, so that a slow queue does not hold back the
            // confirms of publishes to the others. (A later `multiple` ack
            // may cover them again; clients only settle what is outstanding.)
            let mut done = std::mem::take(&mut ch.confirm_done);
            done.sort_unstable();
            for seq in done {
                if seq <= ch.confirm_acked {
                    continue;
                }
                self.amqp.reply(
                    ch_id,
                    Reply::Ack {
                        delivery_tag: seq,
                        multiple: false,
                    },
                );
                if let Some(at) = ch.confirm_started.remove(&seq) {
                    self.counters.confirmed += 1;
                    ch.counters.confirmed += 1;
                    self.latency.observe(now_ms.saturating_sub(at));
                }
            }
        }
    }
}

/// A message to put into queues.
#[derive(Debug, Clone)]
struct Msg {
    meta: Bytes,
    body: Bytes,
    persistent: bool,
    expiration_ms: Option<u64>,
    /// The `priority` property (0 if absent).
    priority: u8,
}

/// A message leaving a queue towards its dead-letter exchange.
#[derive(Debug)]
struct DeadLetter {
    vhost: String,
    exchange: String,
    routing_key: Option<String>,
    queue: Arc<str>,
    reason: DropReason,
    meta: Bytes,
    body: Bytes,
}

/// Group commits prepared by [`Broker::prepare_sync`], to run without the
/// broker's lock and hand back to [`Broker::complete_sync`].
#[derive(Debug, Default)]
pub struct SyncBatch {
    jobs: Vec<(String, Arc<str>, u64, SyncJob, bool)>,
}

impl SyncBatch {
    /// Whether there is nothing to sync.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// Runs the fsyncs (blocking), all queues' together
    /// ([`SyncJob::run_all`]: one `syncfs` for many logs).
    pub fn run(&mut self) {
        let mut jobs: Vec<&mut SyncJob> = self.jobs.iter_mut().map(|j| &mut j.3).collect();
        let results = SyncJob::run_all(&mut jobs);
        for ((vhost, name, _, _, ok), res) in self.jobs.iter_mut().zip(results) {
            match res {
                Ok(()) => *ok = true,
                Err(e) => tracing::error!(%vhost, queue = %name, error = %e, "group commit failed"),
            }
        }
    }
}

/// One Warren node's broker: every vhost, user, exchange, queue and client
/// connection, behind one lock held by the shell.
///
/// The shell creates a connection with [`connect`](Self::connect), feeds its
/// bytes to [`handle_input`](Self::handle_input), writes what
/// [`take_output`](Self::take_output) gives in one write, calls
/// [`handle_conn_tick`](Self::handle_conn_tick) at
/// [`poll_conn_timeout`](Self::poll_conn_timeout), and ends it with
/// [`disconnect`](Self::disconnect). Deliveries to other connections wake
/// their tasks through their [`Waker`]. Group commits run off the lock:
/// [`prepare_sync`](Self::prepare_sync), [`SyncBatch::run`],
/// [`complete_sync`](Self::complete_sync).
pub struct Broker {
    cfg: BrokerConfig,
    meta: Box<dyn MetadataStore>,
    users: HashMap<String, UserDef>,
    vhosts: HashMap<String, Vhost>,
    conns: IdMap<ConnId, Conn>,
    next_conn: ConnId,
    next_msg_id: u64,
    next_uid: u64,
    now: u64,
    /// When [`Self::tick`] last ran (0: never).
    last_tick_ms: u64,
    /// Whether the last tick ended a stall (and expired no queue).
    tick_stalled: bool,
    current: ConnId,
    sync_waker: Option<Waker>,
    sync_wanted: bool,
    dead: Vec<DeadLetter>,
    dl_depth: u8,
    /// This broker's publisher identity in mirrored queues' publish ids.
    publisher_id: u64,
    /// The next publish sequence number into a mirrored queue.
    next_publish: u64,
    /// Publishes a replica refused during `enqueue`, nacked after it.
    deferred_nacks: Vec<(ConnId, ChannelId, u64)>,
    /// Forwarding to and from other nodes.
    links: link::Links,
    /// Mirrored queues whose ring backlog is over the high-water mark:
    /// publishers wait (credit-based flow control, as RabbitMQ's).
    backlogged: HashSet<(String, Arc<str>)>,
    /// Resource alarms: publishers are blocked while one is in force.
    alarms: alarm::Alarms,
    /// The traffic counts of closed client connections.
    retired_counters: stats::MessageCounters,
    /// The confirm latencies of closed client connections.
    retired_latency: stats::LatencyHistogram,
    /// The stored policies, as applied to queues ([`Broker::apply_policies`]).
    policies: warren_policy::PolicySet,
}

impl fmt::Debug for Broker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Broker")
            .field("node", &self.cfg.node_name)
            .field("vhosts", &self.vhosts.len())
            .field("connections", &self.conns.len())
            .finish_non_exhaustive()
    }
}

fn err(code: ReplyCode, text: impl Into<String>) -> AmqpError {
    AmqpError::new(code, text)
}

fn random_name(prefix: &str) -> String {
    use base64::Engine as _;
    let mut b = [0u8; 16];
    rand::rng().fill_bytes(&mut b);
    format!(
        "{prefix}{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
    )
}

fn method_ids(c: &Command) -> (u16, u16) {
    match c {
        Command::ExchangeDeclare(_) => (40, 10),
        Command::ExchangeDelete(_) => (40, 20),
        Command::ExchangeBind(_) => (40, 30),
        Command::ExchangeUnbind(_) => (40, 40),
        Command::QueueDeclare(_) => (50, 10),
        Command::QueueBind(_) => (50, 20),
        Command::QueuePurge(_) => (50, 30),
        Command::QueueDelete(_) => (50, 40),
        Command::QueueUnbind(_) => (50, 50),
        Command::BasicQos(_) => (60, 10),
        Command::BasicConsume(_) => (60, 20),
        Command::BasicCancel(_) => (60, 30),
        Command::BasicPublish(_) => (60, 40),
        Command::BasicGet(_) => (60, 70),
        Command::BasicAck(_) => (60, 80),
        Command::BasicReject(_) => (60, 90),
        Command::BasicRecoverAsync(_) => (60, 100),
        Command::BasicRecover(_) => (60, 110),
        Command::BasicNack(_) => (60, 120),
        Command::ConfirmSelect(_) => (85, 10),
        Command::TxSelect => (90, 10),
        Command::TxCommit => (90, 20),
        Command::TxRollback => (90, 30),
        _ => (0, 0),
    }
}

fn builtin_exchanges() -> Vec<(&'static str, Kind)> {
    vec![
        ("amq.direct", Kind::Direct),
        ("amq.fanout", Kind::Fanout),
        ("amq.topic", Kind::Topic),
        ("amq.headers", Kind::Headers),
        ("amq.match", Kind::Headers),
    ]
}

fn new_vhost() -> Vhost {
    let mut v = Vhost::default();
    for (name, kind) in builtin_exchanges() {
        v.exchanges.insert(
            name.to_owned(),
            Exchange {
                kind,
                durable: true,
                auto_delete: false,
                internal: false,
                arguments: FieldTable::default(),
                bindings: Vec::new(),
            },
        );
    }
    v
}

/// Queue arguments checked and turned into settings.
struct QueueArgs {
    /// What the store enforces (with `reject`, no length limits: the
    /// queue refuses publishes instead of dropping its head).
    limits: Limits,
    expires_ms: Option<u64>,
    dlx: Option<String>,
    dlrk: Option<String>,
    /// `x-overflow` as given (`None`: not given, drop-head).
    overflow: Option<warren_policy::Overflow>,
    /// Set from `overflow` by [`policies::effective_args`].
    reject: Option<RejectPublish>,
    /// `x-max-priority`.
    max_priority: Option<u8>,
    /// `x-queue-master-locator`.
    locator: Option<MasterLocator>,
}

/// `x-overflow: reject-publish` (or `reject-publish-dlx`): a full queue
/// refuses new publishes (nacked) instead of dropping its oldest messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RejectPublish {
    max_length: Option<u64>,
    max_length_bytes: Option<u64>,
    /// `reject-publish-dlx`: refused messages are dead-lettered too.
    dead_letter: bool,
}

impl RejectPublish {
    /// Whether a queue with `stats` refuses another publish.
    fn full(&self, stats: &warren_backing_queue::Stats) -> bool {
        self.max_length.is_some_and(|m| stats.ready >= m)
            || self
                .max_length_bytes
                .is_some_and(|m| stats.ready_bytes >= m)
    }
}

fn queue_args(args: &FieldTable, queue: &str, vhost: &str) -> Result<QueueArgs, AmqpError> {
    let bad = |k: &str, why: &str| {
        err(
            ReplyCode::PreconditionFailed,
            format!("invalid arg '{k}' for queue '{queue}' in vhost '{vhost}': {why}"),
        )
    };
    let mut out = QueueArgs {
        limits: Limits::default(),
        expires_ms: None,
        dlx: None,
        dlrk: None,
        overflow: None,
        reject: None,
        max_priority: None,
        locator: None,
    };
    for (k, v) in args.inner() {
        let key = k.as_str();
        let non_neg = || match as_i64(v) {
            Some(i) if i >= 0 => Ok(i as u64),
            Some(_) => Err(bad(key, "must be non-negative")),
            None => Err(bad(key, "must be an integer")),
        };
        match key {
            "x-message-ttl" => out.limits.message_ttl_ms = Some(non_neg()?),
            "x-max-length" => out.limits.max_length = Some(non_neg()?),
            "x-max-length-bytes" => out.limits.max_length_bytes = Some(non_neg()?),
            "x-expires" => {
                let n = non_neg()?;
                if n == 0 {
                    return Err(bad(key, "must be positive"));
                }
                out.expires_ms = Some(n);
            }
            "x-dead-letter-exchange" => {
                let dlx = as_str(v).ok_or_else(|| bad(key, "must be a string"))?;
                check_name(&dlx).map_err(|e| bad(key, &e.to_string()))?;
                out.dlx = Some(dlx);
            }
            "x-dead-letter-routing-key" => {
                let dlrk = as_str(v).ok_or_else(|| bad(key, "must be a string"))?;
                if dlrk.len() > MAX_NAME_BYTES {
                    return Err(bad(key, &BadName::TooLong(dlrk.len()).to_string()));
                }
                out.dlrk = Some(dlrk);
            }
            "x-overflow" => {
                use warren_policy::Overflow;
                out.overflow = Some(match as_str(v).as_deref() {
                    Some("drop-head") => Overflow::DropHead,
                    Some("reject-publish") => Overflow::RejectPublish,
                    Some("reject-publish-dlx") => Overflow::RejectPublishDlx,
                    _ => {
                        return Err(bad(
                            key,
                            "must be drop-head, reject-publish or reject-publish-dlx",
                        ));
                    }
                });
            }
            "x-max-priority" => {
                // RabbitMQ 3.10's checks and texts: an integer type (not a
                // timestamp), 0 ..= 255.
                let n = match v {
                    AMQPValue::Timestamp(_) => None,
                    v => as_i64(v),
                };
                let Some(n) = n else {
                    let why = format!("\"expected integer, got {}\"", type_name(v));
                    return Err(bad(key, &why));
                };
                let max = u8::try_from(n).map_err(|_| {
                    bad(
                        key,
                        &if n < 0 {
                            format!("{{value_negative,{n}}}")
                        } else {
                            format!("{{max_value_exceeded,{n}}}")
                        },
                    )
                })?;
                out.max_priority = Some(max);
            }
            "x-queue-master-locator" => {
                // RabbitMQ 3.10 crashes the channel on any other value and
                // closes the connection with a bare 541.
                let name = as_str(v).unwrap_or_default();
                out.locator = Some(
                    MasterLocator::from_name(&name)
                        .ok_or_else(|| err(ReplyCode::InternalError, ""))?,
                );
            }
            "x-queue-type" if as_str(v).as_deref() != Some("classic") => {
                return Err(bad(key, "only classic queues are supported"));
            }
            _ => {}
        }
    }
    if out.dlrk.is_some() && out.dlx.is_none() {
        return Err(bad(
            "x-dead-letter-routing-key",
            "x-dead-letter-exchange must be set too",
        ));
    }
    Ok(out)
}

/// RabbitMQ's 406 for redeclaring with other settings.
fn inequivalent(what: &str, arg: &str, name: &str, vhost: &str, got: &str, cur: &str) -> AmqpError {
    err(
        ReplyCode::PreconditionFailed,
        format!(
            "inequivalent arg '{arg}' for {what} '{name}' in vhost '{vhost}': received '{got}' but current is '{cur}'"
        ),
    )
}

fn tables_equivalent(a: &FieldTable, b: &FieldTable) -> Option<String> {
    let keys: HashSet<&str> = a
        .inner()
        .keys()
        .chain(b.inner().keys())
        .map(ShortString::as_str)
        .collect();
    let mut keys: Vec<&str> = keys.into_iter().collect();
    keys.sort_unstable();
    for k in keys {
        let (x, y) = (a.inner().get(k), b.inner().get(k));
        let same = match (x, y) {
            (Some(x), Some(y)) => routing::values_equal(x, y),
            (None, None) => true,
            _ => false,
        };
        if !same {
            return Some(k.to_owned());
        }
    }
    None
}

/// Refuses a name AMQP could not carry (see [`names`](crate::names)).
pub(crate) fn valid_name(kind: &str, name: &str) -> Result<(), BrokerError> {
    check_name(name)
        .map_err(|e| BrokerError::Invalid(format!("{kind} name '{}' is invalid: {e}", shown(name))))
}

/// Where durable queue `name` of `vhost` keeps its log: a hash of the vhost,
/// a NUL, and the name. No vhost holds a NUL (see [`valid_name`]), so the
/// first NUL splits the pair one way only and no two pairs share a directory.
fn queue_dir(data_dir: &std::path::Path, vhost: &str, name: &str) -> PathBuf {
    let mut h = Sha256::new();
    h.update(vhost.as_bytes());
    h.update([0]);
    h.update(name.as_bytes());
    let d = h.finalize();
    let hex: String = d[..12].iter().map(|b| format!("{b:02x}")).collect();
    data_dir.join("queues").join(hex)
}

/// Routes a message from exchange `ex` into `out` (queue names).
fn route(v: &Vhost, ex: &str, rk: &str, headers: Option<&FieldTable>, out: &mut Vec<Arc<str>>) {
    if ex.is_empty() {
        if let Some((k, _)) = v.queues.get_key_value(rk) {
            out.push(k.clone());
        }
        return;
    }
    let mut visited = Vec::new();
    route_rec(v, ex, rk, headers, out, &mut visited);
    if out.len() > 1 {
        let mut seen = HashSet::new();
        out.retain(|q| seen.insert(q.clone()));
    }
}

fn route_rec<'a>(
    v: &'a Vhost,
    ex: &'a str,
    rk: &str,
    headers: Option<&FieldTable>,
    out: &mut Vec<Arc<str>>,
    visited: &mut Vec<&'a str>,
) {
    if visited.contains(&ex) {
        return;
    }
    visited.push(ex);
    let Some(x) = v.exchanges.get(ex) else {
        return;
    };
    let before = out.len();
    for b in &x.bindings {
        let hit = match x.kind {
            Kind::Direct => b.key == rk,
            Kind::Fanout => true,
            Kind::Topic => routing::topic_matches(&b.key, rk),
            Kind::Headers => routing::headers_match(&b.args, headers),
        };
        if hit {
            match &b.dest {
                Dest::Queue(q) => out.push(q.clone()),
                Dest::Exchange(e) => route_rec(v, e, rk, headers, out, visited),
            }
        }
    }
    if out.len() == before
        && let Some(ae) = x
            .arguments
            .inner()
            .get("alternate-exchange")
            .and_then(as_str)
        && let Some((ae, _)) = v.exchanges.get_key_value(ae.as_str())
    {
        route_rec(v, ae, rk, headers, out, visited);
    }
}

/// Hands ready messages of `q` to its consumers, round-robin, within
/// their prefetch limits.
fn drive(q: &mut Queue, conns: &mut IdMap<ConnId, Conn>, now: u64, current: ConnId) {
    if q.consumers.is_empty() || q.remote.is_some() {
        return;
    }
    q.last_used_ms = now;
    if matches!(q.store, Store::Replica(_)) {
        drive_replica(q, conns, now);
        return;
    }
    let Store::Local(bq) = &mut q.store else {
        return;
    };
    loop {
        if bq.stats().ready == 0 {
            return;
        }
        let n = q.consumers.len();
        let mut chosen = None;
        for i in 0..n {
            let idx = (q.rr + i) % n;
            let c = &q.consumers[idx];
            let Some(conn) = conns.get_mut(&c.conn) else {
                continue;
            };
            let Some(ch) = conn.channels.get(&c.channel) else {
                continue;
            };
            if c.prefetch != 0 && c.unacked >= u32::from(c.prefetch) && !c.no_ack {
                continue;
            }
            if ch.global_prefetch != 0
                && ch.unacked.len() >= usize::from(ch.global_prefetch)
                && !c.no_ack
            {
                continue;
            }
            if conn.out_pending >= OUTPUT_HIGH_WATER {
                conn.throttled = true;
                continue;
            }
            chosen = Some(idx);
            break;
        }
        let Some(idx) = chosen else {
            return;
        };
        let delivery = match bq.fetch(now) {
            Ok(Some(d)) => d,
            Ok(None) => return,
            Err(e) => {
                tracing::error!(queue = %q.name, error = %e, "fetch failed");
                return;
            }
        };
        q.rr = idx + 1;
        q.delivered_at_ms = now;
        q.counters.delivered += 1;
        q.counters.redelivered += u64::from(delivery.redelivered);
        let c = &mut q.consumers[idx];
        let Some(conn) = conns.get_mut(&c.conn) else {
            continue;
        };
        let Some(ch) = conn.channels.get_mut(&c.channel) else {
            continue;
        };
        ch.next_tag += 1;
        let tag = ch.next_tag;
        if c.no_ack {
            if let Err(e) = bq.ack(delivery.tag) {
                tracing::error!(queue = %q.name, error = %e, "ack failed");
            }
            q.dl_msgs.remove(&delivery.id);
        } else {
            c.unacked += 1;
            ch.unacked.insert(
                tag,
                Unacked {
                    queue: q.name.clone(),
                    bq_tag: delivery.tag,
                    consumer: Some(c.tag.clone()),
                    msg_id: delivery.id,
                    remote: None,
                },
            );
        }
        let m = decode_meta(&delivery.props);
        conn.send_message(
            c.channel,
            &ContentMethod::Deliver {
                consumer_tag: &c.tag,
                delivery_tag: tag,
                redelivered: delivery.redelivered,
                exchange: m.exchange,
                routing_key: m.routing_key,
            },
            &m.properties,
            &delivery.props,
            &delivery.body,
        );
        conn.out_pending += delivery.body.len() + 64;
        let cid = c.conn;
        conn.wake(current, cid);
    }
}

/// Fetches from a mirrored queue's replica for its consumers, round-robin,
/// within their prefetch limits (counting fetches not yet handed out); the
/// deliveries go out when the ring holds the fetches.
fn drive_replica(q: &mut Queue, conns: &mut IdMap<ConnId, Conn>, now: u64) {
    if !matches!(q.store, Store::Replica(_)) || !q.store.serves() {
        return;
    }
    loop {
        if q.store.stats().ready == 0 {
            return;
        }
        let n = q.consumers.len();
        let mut chosen = None;
        for i in 0..n {
            let idx = (q.rr + i) % n;
            let c = &q.consumers[idx];
            let Some(conn) = conns.get_mut(&c.conn) else {
                continue;
            };
            if !conn.channels.contains_key(&c.channel) {
                continue;
            }
            if c.prefetch != 0 && c.unacked >= u32::from(c.prefetch) && !c.no_ack {
                continue;
            }
            // Fetches in flight come back through `mirror_turn`, which
            // drives the queue again; a full socket buffer is retried once
            // the connection's output is written (`throttled`).
            if c.reserved >= MAX_FETCHES_IN_FLIGHT {
                continue;
            }
            if conn.out_pending >= OUTPUT_HIGH_WATER {
                conn.throttled = true;
                continue;
            }
            chosen = Some(idx);
            break;
        }
        let Some(idx) = chosen else {
            return;
        };
        q.rr = idx + 1;
        let c = &mut q.consumers[idx];
        let f = FetchForArgs::consumer(c.conn, c.channel, c.tag.clone(), c.no_ack);
        let Store::Replica(m) = &mut q.store else {
            return;
        };
        if !m.fetch(now, f) {
            return;
        }
        c.reserved += 1;
        if !c.no_ack {
            c.unacked += 1;
        }
    }
}

impl Broker {
    /// Queue `name` of `vhost`, if this node has it.
    fn queue_mut(&mut self, vhost: &str, name: &str) -> Option<&mut Queue> {
        self.vhosts.get_mut(vhost)?.queues.get_mut(name)
    }

    /// Opens a broker over `meta`: creates the default vhost `/` and the
    /// `guest`/`guest` user (loopback only) on first start, and recovers the
    /// durable exchanges, queues (with their persistent messages) and bindings.
    pub fn open(cfg: BrokerConfig, meta: Box<dyn MetadataStore>) -> Result<Self, BrokerError> {
        let mut b = Self {
            cfg,
            meta,
            users: HashMap::new(),
            vhosts: HashMap::new(),
            conns: IdMap::default(),
            next_conn: 1,
            next_msg_id: 1,
            next_uid: 1,
            now: 0,
            last_tick_ms: 0,
            tick_stalled: false,
            current: 0,
            sync_waker: None,
            sync_wanted: false,
            dead: Vec::new(),
            dl_depth: 0,
            publisher_id: rand::rng().next_u64(),
            next_publish: 1,
            deferred_nacks: Vec::new(),
            links: link::Links::default(),
            backlogged: HashSet::new(),
            alarms: alarm::Alarms::default(),
            retired_counters: stats::MessageCounters::default(),
            retired_latency: stats::LatencyHistogram::default(),
            policies: warren_policy::PolicySet::new(),
        };
        let mut defs = b.meta.load();
        b.policies = policies::policy_set(&defs.policies);
        if defs.vhosts.is_empty() && defs.users.is_empty() {
            b.meta.apply(Change::PutVhost("/".into()))?;
            b.meta.apply(Change::PutUser(UserDef {
                name: "guest".into(),
                password_hash: auth::hash_password("guest"),
                tags: vec!["administrator".into()],
                loopback_only: true,
            }))?;
            b.meta.apply(Change::PutPermission(PermissionDef {
                user: "guest".into(),
                vhost: "/".into(),
                configure: ".*".into(),
                write: ".*".into(),
                read: ".*".into(),
            }))?;
            defs = b.meta.load();
        }
        for v in &defs.vhosts {
            b.vhosts.insert(v.clone(), new_vhost());
        }
        for u in defs.users {
            b.users.insert(u.name.clone(), u);
        }
        for p in defs.permissions {
            if let Some(v) = b.vhosts.get_mut(&p.vhost) {
                v.permissions.insert(p.user.clone(), p);
            }
        }
        for e in defs.exchanges {
            let Some(v) = b.vhosts.get_mut(&e.vhost) else {
                continue;
            };
            let Some(kind) = Kind::parse(&e.kind) else {
                continue;
            };
            v.exchanges.insert(
                e.name.clone(),
                Exchange {
                    kind,
                    durable: e.durable,
                    auto_delete: e.auto_delete,
                    internal: e.internal,
                    arguments: e.arguments,
                    bindings: Vec::new(),
                },
            );
        }
        for q in defs.queues {
            let opts = QueueOpts {
                durable: q.durable,
                exclusive: false,
                auto_delete: q.auto_delete,
                arguments: q.arguments,
            };
            let name: Arc<str> = Arc::from(q.name.as_str());
            let queue = b.make_queue(&q.vhost, name, opts, None)?;
            tracing::info!(vhost = %q.vhost, queue = %q.name, messages = queue.store.stats().ready, "recovered queue");
            if let Some(v) = b.vhosts.get_mut(&q.vhost) {
                v.queues.insert(queue.name.clone(), queue);
            }
        }
        for bd in defs.bindings {
            let Some(v) = b.vhosts.get_mut(&bd.vhost) else {
                continue;
            };
            let dest = if bd.destination_is_exchange {
                Dest::Exchange(bd.destination.clone())
            } else {
                match v.queues.get_key_value(bd.destination.as_str()) {
                    Some((k, _)) => Dest::Queue(k.clone()),
                    None => continue,
                }
            };
            if let Some(x) = v.exchanges.get_mut(&bd.source) {
                x.bindings.push(Binding {
                    dest,
                    key: bd.routing_key,
                    args: bd.arguments,
                });
            }
        }
        Ok(b)
    }

    fn make_queue(
        &mut self,
        vhost: &str,
        name: Arc<str>,
        opts: QueueOpts,
        owner: Option<ConnId>,
    ) -> Result<Queue, BrokerError> {
        let def = self.queue_policy(vhost, &name, opts.exclusive);
        let args = policies::effective_args(&opts.arguments, &name, vhost, &def)
            .map_err(|e| BrokerError::Invalid(e.to_string()))?;
        let qcfg = QueueConfig {
            limits: args.limits,
            record_ops: false,
            // A policy may name a dead-letter exchange later.
            report_dropped: true,
            max_priority: args.max_priority,
        };
        let (bq, dir) = if opts.durable && !opts.exclusive {
            let dir = queue_dir(&self.cfg.data_dir, vhost, &name);
            let (bq, report) = BackingQueue::open_in(
                self.cfg.storage.clone(),
                &dir,
                qcfg,
                StoreConfig::default(),
            )?;
            if let Some((file, off)) = report.truncated {
                tracing::warn!(file = %file.display(), offset = off, "cut a torn tail off a queue log");
            }
            (bq, Some(dir))
        } else {
            (BackingQueue::in_memory(qcfg), None)
        };
        let uid = self.next_uid;
        self.next_uid += 1;
        Ok(Queue {
            name,
            uid,
            opts,
            owner,
            store: Store::Local(bq),
            remote: None,
            handed_over: false,
            consumers: Vec::new(),
            rr: 0,
            had_consumers: false,
            dlx: args.dlx,
            dlrk: args.dlrk,
            expires_ms: args.expires_ms,
            reject: args.reject,
            limits: args.limits,
            max_priority: args.max_priority,
            delivered_at_ms: 0,
            last_used_ms: self.now,
            dl_msgs: HashMap::new(),
            remote_figures: None,
            confirms: VecDeque::new(),
            dir,
            counters: stats::QueueCounters::default(),
        })
    }

    /// Adds a vhost (durably), with its built-in exchanges.
    pub fn add_vhost(&mut self, name: &str) -> Result<(), BrokerError> {
        if !self.vhosts.contains_key(name) {
            valid_name("vhost", name)?;
            self.meta.apply(Change::PutVhost(name.to_owned()))?;
            self.vhosts.insert(name.to_owned(), new_vhost());
        }
        Ok(())
    }

    /// Adds or replaces a user (durably).
    pub fn put_user(&mut self, user: UserDef) -> Result<(), BrokerError> {
        valid_name("user", &user.name)?;
        self.meta.apply(Change::PutUser(user.clone()))?;
        self.users.insert(user.name.clone(), user);
        Ok(())
    }

    /// Sets a user's permissions in a vhost (durably).
    pub fn set_permissions(&mut self, p: PermissionDef) -> Result<(), BrokerError> {
        for re in [&p.configure, &p.write, &p.read] {
            if !auth::valid_regex(re) {
                return Err(BrokerError::Invalid(format!(
                    "invalid permission regex '{re}'"
                )));
            }
        }
        let Some(v) = self.vhosts.get_mut(&p.vhost) else {
            return Err(BrokerError::Invalid(format!("no vhost '{}'", p.vhost)));
        };
        self.meta.apply(Change::PutPermission(p.clone()))?;
        v.permissions.insert(p.user.clone(), p);
        Ok(())
    }

    /// Sets the waker of the task that runs group commits.
    pub fn set_sync_waker(&mut self, waker: Waker) {
        self.sync_waker = Some(waker);
    }

    /// The node's counts.
    #[must_use]
    pub fn overview(&self) -> Overview {
        let mut o = Overview::default();
        for c in self.client_conns() {
            o.connections += 1;
            o.channels += c.channels.len() as u64;
        }
        for v in self.vhosts.values() {
            o.exchanges += v.exchanges.len() as u64 + 1;
            o.queues += v.queues.len() as u64;
            for q in v.queues.values() {
                let s = q.store.stats();
                o.messages_ready += s.ready;
                o.messages_unacknowledged += s.unacked;
                o.consumers += self.client_consumers(q) as u64;
            }
        }
        o
    }

    /// A new client connection from `peer`; `waker` wakes its task when
    /// another connection's work left output for it.
    pub fn connect(&mut self, peer: SocketAddr, waker: Waker) -> ConnId {
        let id = self.next_conn;
        self.next_conn += 1;
        let mut cfg = self.cfg.amqp.clone();
        cfg.cluster_name = Some(self.cfg.node_name.clone());
        let mut amqp = Connection::new(cfg);
        amqp.hold_publishes(self.alarmed());
        self.conns.insert(
            id,
            Conn {
                amqp,
                peer,
                user: String::new(),
                vhost: String::new(),
                perm: None,
                channels: IdMap::default(),
                waker,
                woken: false,
                out_pending: 0,
                throttled: false,
                confirm_dirty: Vec::new(),
                closed: false,
                link: None,
                publisher: false,
                targets: Vec::new(),
                counters: stats::MessageCounters::default(),
                latency: stats::LatencyHistogram::default(),
                octets: stats::Octets::default(),
            },
        );
        id
    }

    /// Feeds bytes read from connection `id`'s socket (consumes every
    /// complete frame) and does all the work they ask for. `now_ms` is the
    /// wall clock in milliseconds.
    pub fn handle_input(&mut self, id: ConnId, buf: &mut BytesMut, now_ms: u64) {
        self.now = now_ms;
        self.current = id;
        let Some(c) = self.conns.get_mut(&id) else {
            buf.clear();
            return;
        };
        let before = buf.len();
        c.amqp.handle_bytes(buf);
        c.octets.received += (before - buf.len()) as u64;
        if !c.publisher && c.amqp.has_published() && c.link.is_none() {
            // A publish has begun (its content may not be here yet): from
            // now on a resource alarm blocks this connection, so partial
            // messages cannot slip past the memory watermark.
            c.publisher = true;
            if self.alarmed() {
                let reason = self.alarms.cluster().to_string();
                self.conn(id).amqp.block(&reason);
            }
        }
        self.process_events(id, Some(buf));
    }

    /// Moves connection `id`'s pending output into `dst` (write it with one
    /// write); returns false once the connection is over (write `dst`, then
    /// close the socket and call [`disconnect`](Self::disconnect)).
    pub fn take_output(&mut self, id: ConnId, dst: &mut BytesMut) -> bool {
        let start = dst.len();
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        c.flush_confirms(self.now);
        c.amqp.take_output(dst);
        c.woken = false;
        c.out_pending = 0;
        if c.throttled {
            c.throttled = false;
            self.resume_deliveries(id);
            if let Some(c) = self.conns.get_mut(&id) {
                c.amqp.take_output(dst);
                c.out_pending = 0;
                // Still more to hand out: come back once this is written.
                if c.throttled {
                    c.woken = true;
                    (c.waker)();
                }
            }
        }
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        c.octets.sent += (dst.len() - start) as u64;
        !c.closed
    }

    /// Hands out again to connection `id`'s consumers, which deliveries
    /// skipped while its output was over [`OUTPUT_HIGH_WATER`].
    pub(crate) fn resume_deliveries(&mut self, id: ConnId) {
        let Some(c) = self.conns.get(&id) else {
            return;
        };
        let vhost = c.vhost.clone();
        let queues: Vec<Arc<str>> = c
            .channels
            .values()
            .flat_map(|ch| ch.consumers.values().cloned())
            .collect();
        self.current = id;
        for q in queues {
            self.after_queue_op(&vhost, &q);
        }
    }

    /// When connection `id`'s timers (heartbeats, handshake, close) need
    /// [`handle_conn_tick`](Self::handle_conn_tick), on the same clock as `now_ms`.
    #[must_use]
    pub fn poll_conn_timeout(&self, id: ConnId) -> Option<u64> {
        self.conns.get(&id).and_then(|c| c.amqp.poll_timeout())
    }

    /// Advances connection `id`'s timers.
    pub fn handle_conn_tick(&mut self, id: ConnId, now_ms: u64) {
        self.now = now_ms;
        self.current = id;
        if let Some(c) = self.conns.get_mut(&id) {
            c.amqp.handle_tick(now_ms);
        }
        self.process_events(id, None);
    }

    /// The shell holds connection `id`'s input unread (it is paused and the
    /// shell's buffer for it is full), or bytes arrived that wait unread:
    /// either way the client is not silent, so its missed-heartbeat clock
    /// starts again.
    pub fn hold_input(&mut self, id: ConnId) {
        if let Some(c) = self.conns.get_mut(&id) {
            c.amqp.input_held();
        }
    }

    /// Connection `id`'s socket is gone: its channels close (unacked
    /// messages are requeued), its exclusive queues are deleted. What it
    /// owned (unfinished messages can be large) is returned, to be dropped
    /// after the broker's lock is released.
    #[must_use = "drop it outside the broker's lock"]
    pub fn disconnect(&mut self, id: ConnId, now_ms: u64) -> Option<Departed> {
        self.now = now_ms;
        self.current = id;
        self.cleanup_conn(id);
        let c = self.conns.remove(&id)?;
        self.retired_counters.add(&c.counters);
        self.retired_latency.add(&c.latency);
        Some(Departed(Box::new(c)))
    }

    /// Closes connection `id` as an operator asked (`close_connection`,
    /// `DELETE /api/connections/NAME`): the client gets connection.close
    /// 320 CONNECTION_FORCED with `reason`, as RabbitMQ sends. Returns false
    /// if there is no such client connection.
    pub fn close_connection(&mut self, id: ConnId, reason: &str) -> bool {
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        // Forwarding links are not clients; one already closing is gone.
        if c.link.is_some() || c.amqp.is_closing() {
            return false;
        }
        tracing::info!(peer = %c.peer, user = %c.user, %reason, "closing connection on request");
        c.amqp
            .connection_error(err(ReplyCode::ConnectionForced, reason.to_owned()));
        c.woken = true;
        (c.waker)();
        true
    }

    /// Closes every connection with 320 CONNECTION_FORCED (their tasks
    /// write the close) before a shutdown.
    pub fn close_all(&mut self, text: &str) {
        for (id, c) in &mut self.conns {
            c.amqp
                .connection_error(err(ReplyCode::ConnectionForced, text.to_owned()));
            c.woken = true;
            (c.waker)();
            let _ = id;
        }
    }

    /// Writes and fsyncs every durable queue's log inline (at shutdown, after
    /// the sync task stopped).
    pub fn sync_all(&mut self) {
        for (vname, v) in &mut self.vhosts {
            for q in v.queues.values_mut() {
                if q.store.needs_sync()
                    && let Err(e) = q.store.sync()
                {
                    tracing::error!(vhost = %vname, queue = %q.name, error = %e, "final sync failed");
                }
            }
        }
    }

    fn want_sync(&mut self) {
        if !self.sync_wanted {
            self.sync_wanted = true;
            if let Some(w) = &self.sync_waker {
                w();
            }
        }
    }

    /// Starts a group commit of every durable queue with unsynced appends.
    pub fn prepare_sync(&mut self) -> SyncBatch {
        self.sync_wanted = false;
        let mut batch = SyncBatch::default();
        for (vname, v) in &mut self.vhosts {
            for q in v.queues.values_mut() {
                if !q.store.needs_sync() {
                    continue;
                }
                match q.store.prepare_sync() {
                    Ok(Some(job)) => {
                        batch
                            .jobs
                            .push((vname.clone(), q.name.clone(), q.uid, job, false))
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::error!(vhost = %vname, queue = %q.name, error = %e, "preparing a group commit failed");
                    }
                }
            }
        }
        batch
    }

    /// Finishes a group commit: confirms the publishes it made durable and
    /// wakes their connections. Returns whether another commit is due.
    pub fn complete_sync(&mut self, batch: SyncBatch, now_ms: u64) -> bool {
        self.now = now_ms;
        self.current = 0;
        let mut seqs = Vec::new();
        let mut replicas = Vec::new();
        for (vname, qname, uid, job, ok) in batch.jobs {
            let Some(q) = self
                .vhosts
                .get_mut(&vname)
                .and_then(|v| v.queues.get_mut(&qname))
            else {
                continue;
            };
            if q.uid != uid {
                continue;
            }
            let bq = match &mut q.store {
                Store::Local(_) if !ok => continue,
                Store::Local(bq) => bq,
                Store::Replica(m) => {
                    // A failed job too: a mirror whose disk failed drops
                    // its state and asks for a sync at once, instead of
                    // counting as synchronised (and promotable) until its
                    // next job.
                    if let Err(e) = m.replica.complete_storage_sync(&job) {
                        tracing::error!(vhost = %vname, queue = %qname, error = %e, "completing a group commit failed");
                    }
                    // Publishes the queue took before it became mirrored
                    // are confirmed by its own disk, as they were promised.
                    let synced = m.replica.synced_seq().unwrap_or(0);
                    while let Some(&(seq, conn, ch, cseq)) = q.confirms.front() {
                        if seq > synced {
                            break;
                        }
                        q.confirms.pop_front();
                        confirm_one(&mut self.conns, conn, ch, cseq);
                    }
                    replicas.push((vname.clone(), qname.clone()));
                    continue;
                }
            };
            if let Err(e) = bq.complete_sync(&job) {
                tracing::error!(vhost = %vname, queue = %qname, error = %e, "completing a group commit failed");
                continue;
            }
            seqs.clear();
            bq.drain_confirmed(&mut seqs);
            let Some(&max) = seqs.last() else {
                continue;
            };
            while let Some(&(seq, conn, ch, cseq)) = q.confirms.front() {
                if seq > max {
                    break;
                }
                q.confirms.pop_front();
                confirm_one(&mut self.conns, conn, ch, cseq);
            }
        }
        for (vname, qname) in replicas {
            self.mirror_turn(&vname, &qname);
        }
        for (id, c) in &mut self.conns {
            if !c.confirm_dirty.is_empty() {
                c.wake(0, *id);
            }
        }
        let more = self
            .vhosts
            .values()
            .any(|v| v.queues.values().any(|q| q.store.needs_sync()));
        if more {
            self.sync_wanted = true;
        }
        more
    }

    /// Expires messages (`x-message-ttl`, `expiration`) and unused queues
    /// (`x-expires`). Call it every few tens of milliseconds.
    pub fn tick(&mut self, now_ms: u64) {
        self.now = now_ms;
        self.current = 0;
        // After a stall (this node's work held up: a slow disk under the
        // lock, an overloaded machine), the clients' input that waited
        // meanwhile — a consume, a declare — goes first: no queue is
        // expired as unused on the tick that ends a stall.
        // (Never two ticks in a row: a node whose every tick is late still
        // expires its queues.)
        let stalled = self.last_tick_ms != 0
            && now_ms.saturating_sub(self.last_tick_ms) > STALL_MS
            && !self.tick_stalled;
        self.tick_stalled = stalled;
        self.last_tick_ms = now_ms;
        self.expire_remote_alarms(now_ms);
        self.expire_counts(now_ms);
        self.peek_masters(now_ms);
        let mut expire = Vec::new();
        let mut delete = Vec::new();
        for (vname, v) in &self.vhosts {
            for q in v.queues.values() {
                if q.store.next_expiry_ms().is_some_and(|t| t < now_ms) {
                    expire.push((vname.clone(), q.name.clone()));
                }
                // Only the node that serves the queue knows every consumer
                // (other nodes' come to it over their links) and every use.
                if let Some(exp) = q.expires_ms
                    && !stalled
                    && q.remote.is_none()
                    && q.consumers.is_empty()
                    && now_ms.saturating_sub(q.last_used_ms) >= exp
                {
                    delete.push((vname.clone(), q.name.clone()));
                }
            }
        }
        for (vname, qname) in expire {
            if let Some(q) = self
                .vhosts
                .get_mut(&vname)
                .and_then(|v| v.queues.get_mut(&qname))
                && let Err(e) = q.store.expire(now_ms)
            {
                tracing::error!(queue = %qname, error = %e, "expiry failed");
            }
            // A mirrored queue's expiries go round its ring now.
            self.mirror_turn(&vname, &qname);
            self.after_queue_op(&vname, &qname);
        }
        for (vname, qname) in delete {
            self.delete_queue(&vname, &qname);
        }
        for (id, c) in &mut self.conns {
            if c.amqp.has_output() {
                c.wake(0, *id);
            }
        }
    }

    fn process_events(&mut self, id: ConnId, mut buf: Option<&mut BytesMut>) {
        loop {
            let Some(c) = self.conns.get_mut(&id) else {
                return;
            };
            let Some(ev) = c.amqp.poll_event() else {
                break;
            };
            match ev {
                Event::Authenticate(creds) => {
                    let ok = self.check_login(id, &creds);
                    if let Some(c) = self.conns.get_mut(&id) {
                        if ok {
                            c.user = creds.username.clone();
                            c.amqp.accept_login();
                        } else {
                            tracing::warn!(user = %creds.username, peer = %c.peer, "login refused");
                            c.amqp.refuse_login();
                        }
                        if let Some(b) = buf.as_deref_mut() {
                            c.amqp.handle_bytes(b);
                        }
                    }
                }
                Event::OpenVhost { vhost } => {
                    let c = self.conns.get_mut(&id).expect("connection present");
                    match self.vhosts.get(&vhost) {
                        None => c.amqp.refuse_vhost(AmqpError::vhost_not_found(&vhost)),
                        Some(v) => match v.permissions.get(&c.user) {
                            None => c
                                .amqp
                                .refuse_vhost(AmqpError::vhost_access_refused(&vhost, &c.user)),
                            Some(p) => {
                                c.perm = Some(Permission::new(p));
                                c.vhost = vhost;
                                c.amqp.accept_vhost();
                            }
                        },
                    }
                    if let Some(b) = buf.as_deref_mut() {
                        c.amqp.handle_bytes(b);
                    }
                }
                Event::ChannelOpened(ch) => {
                    c.channels.insert(ch, Channel::default());
                }
                Event::ChannelClosed { channel, .. } => self.close_channel(id, channel),
                Event::Command { channel, command } => {
                    let ids = method_ids(&command);
                    if let Err(mut e) = self.command(id, channel, command) {
                        if e.class_id == 0 {
                            e = e.with_method(ids.0, ids.1);
                        }
                        if let Some(c) = self.conns.get_mut(&id) {
                            if e.code.is_hard() {
                                c.amqp.connection_error(e);
                            } else {
                                c.amqp.channel_error(channel, e);
                            }
                        }
                    }
                }
                Event::Closed(reason) => {
                    tracing::debug!(conn = id, ?reason, "connection closed");
                    self.cleanup_conn(id);
                    if let Some(c) = self.conns.get_mut(&id) {
                        c.closed = true;
                    }
                }
                _ => {}
            }
        }
        if let Some(c) = self.conns.get_mut(&id) {
            c.flush_confirms(self.now);
        }
    }

    fn check_login(&self, id: ConnId, creds: &Credentials) -> bool {
        let Some(c) = self.conns.get(&id) else {
            return false;
        };
        let Some(u) = self.users.get(&creds.username) else {
            return false;
        };
        if u.loopback_only && !c.peer.ip().is_loopback() {
            return false;
        }
        auth::check_password(&u.password_hash, &creds.password)
    }

    fn cleanup_conn(&mut self, id: ConnId) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let chans: Vec<ChannelId> = c.channels.keys().copied().collect();
        let vhost = c.vhost.clone();
        for ch in chans {
            self.close_channel(id, ch);
        }
        let Some(v) = self.vhosts.get(&vhost) else {
            return;
        };
        let exclusive: Vec<Arc<str>> = v
            .queues
            .values()
            .filter(|q| q.owner == Some(id))
            .map(|q| q.name.clone())
            .collect();
        for q in exclusive {
            self.delete_queue(&vhost, &q);
        }
    }

    fn close_channel(&mut self, id: ConnId, ch_id: ChannelId) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let Some(ch) = c.channels.remove(&ch_id) else {
            return;
        };
        let vhost = c.vhost.clone();
        let Some(v) = self.vhosts.get_mut(&vhost) else {
            return;
        };
        let mut touched: Vec<Arc<str>> = Vec::new();
        let mut forwarded = Vec::new();
        for (tag, qname) in &ch.consumers {
            if let Some(q) = v.queues.get_mut(qname) {
                if let Some(node) = &q.remote {
                    for x in &q.consumers {
                        if x.conn == id && x.channel == ch_id && &x.tag == tag {
                            forwarded.push((node.clone(), x.remote_cid));
                        }
                    }
                }
                q.consumers
                    .retain(|x| !(x.conn == id && x.channel == ch_id && &x.tag == tag));
                touched.push(qname.clone());
            }
        }
        let mut settle_remote = Vec::new();
        for u in ch.unacked.into_values() {
            if let Some(node) = u.remote {
                settle_remote.push((node, u.bq_tag));
                continue;
            }
            if let Some(q) = v.queues.get_mut(&u.queue) {
                if let Err(e) = q.store.requeue(u.bq_tag) {
                    tracing::error!(queue = %u.queue, error = %e, "requeue failed");
                }
                touched.push(u.queue);
            }
        }
        for (node, cid) in forwarded {
            self.link_cancel(&node, &vhost, cid);
        }
        for (node, tag) in settle_remote {
            self.link_settle(&node, &vhost, tag, Settle::Requeue);
        }
        touched.sort();
        touched.dedup();
        for q in touched {
            if self.auto_delete_if_unused(&vhost, &q) {
                continue;
            }
            self.after_queue_op(&vhost, &q);
        }
    }

    fn auto_delete_if_unused(&mut self, vhost: &str, qname: &str) -> bool {
        let del = self
            .vhosts
            .get(vhost)
            .and_then(|v| v.queues.get(qname))
            .is_some_and(|q| {
                // The serving node decides: it sees every node's consumers.
                q.remote.is_none()
                    && q.opts.auto_delete
                    && q.had_consumers
                    && q.consumers.is_empty()
            });
        if del {
            self.delete_queue(vhost, qname);
        }
        del
    }

    /// After a queue changed: dead-letters what it dropped, hands ready
    /// messages to consumers.
    fn after_queue_op(&mut self, vhost: &str, qname: &str) {
        let Some(v) = self.vhosts.get_mut(vhost) else {
            return;
        };
        let Some(q) = v.queues.get_mut(qname) else {
            return;
        };
        drive(q, &mut self.conns, self.now, self.current);
        if matches!(q.store, Store::Replica(_)) {
            self.mirror_turn(vhost, qname);
        }
        let Some(q) = self
            .vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(qname))
        else {
            return;
        };
        let mut dropped: Vec<Dropped> = Vec::new();
        q.store.take_dropped(&mut dropped);
        if q.dlx.is_some() {
            for d in dropped {
                if let Some((meta, body)) = q.dl_msgs.remove(&d.id) {
                    self.dead.extend(q.dead_letter(vhost, d.reason, meta, body));
                }
            }
            // Expired messages at the head may have gone during the fetches.
            drive(q, &mut self.conns, self.now, self.current);
        }
        self.dead_letter();
    }

    fn dead_letter(&mut self) {
        if self.dl_depth >= DEAD_LETTER_DEPTH {
            self.dead.clear();
            return;
        }
        self.dl_depth += 1;
        // Oldest first: dead letters keep the order their queue dropped them in.
        while !self.dead.is_empty() {
            for d in std::mem::take(&mut self.dead) {
                let m = decode_meta(&d.meta);
                let reason = match d.reason {
                    DropReason::Expired => "expired",
                    DropReason::MaxLength => "maxlen",
                    DropReason::Rejected => "rejected",
                };
                let mut props = m.properties.clone();
                let mut headers = props.headers().clone().unwrap_or_default();
                let mut deaths: Vec<AMQPValue> = match headers.inner().get("x-death") {
                    Some(AMQPValue::FieldArray(a)) => a.as_slice().to_vec(),
                    _ => Vec::new(),
                };
                // Cycle: the message already died in this queue for this reason
                // without a client rejecting it: drop it, as RabbitMQ does.
                let cycle = deaths.iter().any(|x| match x {
                    AMQPValue::FieldTable(t) => {
                        t.inner().get("queue").and_then(as_str).as_deref() == Some(&*d.queue)
                            && d.reason != DropReason::Rejected
                    }
                    _ => false,
                });
                if cycle {
                    continue;
                }
                let mut death = FieldTable::default();
                death.insert("count".into(), AMQPValue::LongLongInt(1));
                death.insert("reason".into(), AMQPValue::LongString(reason.into()));
                death.insert("queue".into(), AMQPValue::LongString((&*d.queue).into()));
                death.insert("exchange".into(), AMQPValue::LongString(m.exchange.into()));
                death.insert(
                    "routing-keys".into(),
                    AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString(
                        m.routing_key.into(),
                    )])),
                );
                death.insert("time".into(), AMQPValue::Timestamp(self.now / 1000));
                if let Some(exp) = props.expiration() {
                    // RabbitMQ keeps the per-message TTL it strips below.
                    death.insert(
                        "original-expiration".into(),
                        AMQPValue::LongString(exp.as_str().into()),
                    );
                }
                deaths.insert(0, AMQPValue::FieldTable(death));
                if !headers.contains_key("x-first-death-reason") {
                    headers.insert(
                        "x-first-death-reason".into(),
                        AMQPValue::LongString(reason.into()),
                    );
                    headers.insert(
                        "x-first-death-queue".into(),
                        AMQPValue::LongString((&*d.queue).into()),
                    );
                    headers.insert(
                        "x-first-death-exchange".into(),
                        AMQPValue::LongString(m.exchange.into()),
                    );
                }
                headers.insert("x-death".into(), AMQPValue::FieldArray(deaths.into()));
                props = props.with_headers(headers);
                // RabbitMQ removes the per-message TTL so that it does not expire again.
                props = strip_expiration(props);
                let rk = d.routing_key.unwrap_or_else(|| m.routing_key.to_owned());
                let persistent = props.delivery_mode() == &Some(2);
                let msg = Msg {
                    meta: encode_meta(&d.exchange, &rk, &props),
                    body: d.body,
                    persistent,
                    expiration_ms: None,
                    priority: props.priority().unwrap_or(0),
                };
                let mut targets = Vec::new();
                if let Some(v) = self.vhosts.get(&d.vhost) {
                    route(v, &d.exchange, &rk, props.headers().as_ref(), &mut targets);
                }
                if let Err(e) = self.enqueue(&d.vhost, &targets, &msg, None) {
                    tracing::error!(error = %e, "dead-lettering failed");
                }
            }
        }
        self.dl_depth -= 1;
    }

    /// Puts `msg` into `targets`; returns how many of them owe a group
    /// commit before `confirm` may be acked.
    fn enqueue(
        &mut self,
        vhost: &str,
        targets: &[Arc<str>],
        msg: &Msg,
        confirm: Option<(ConnId, ChannelId, u64)>,
    ) -> Result<u32, AmqpError> {
        let mut pending = 0;
        let mut nacks = Vec::new();
        let id = self.next_msg_id;
        self.next_msg_id += 1;
        let mut sync = false;
        for qname in targets {
            let Some(q) = self
                .vhosts
                .get_mut(vhost)
                .and_then(|v| v.queues.get_mut(qname))
            else {
                continue;
            };
            let nm = NewMessage {
                id,
                props: msg.meta.clone(),
                body: msg.body.clone(),
                persistent: msg.persistent,
                expiration_ms: msg.expiration_ms,
                priority: msg.priority,
            };
            if let Some(node) = q.remote.clone() {
                pending += u32::from(self.link_publish(&node, vhost, qname, msg, confirm));
                continue;
            }
            if let Some(r) = q.reject
                && r.full(&q.store.stats())
            {
                // Full with reject-publish: refused, as RabbitMQ's queue
                // does, and dead-lettered with reject-publish-dlx.
                if let Some((conn, ch, cseq)) = confirm {
                    pending += 1;
                    nacks.push((conn, ch, cseq));
                }
                if r.dead_letter {
                    let (meta, body) = (msg.meta.clone(), msg.body.clone());
                    let reason = DropReason::MaxLength;
                    self.dead.extend(q.dead_letter(vhost, reason, meta, body));
                }
                continue;
            }
            q.counters.published += 1;
            let bq = match &mut q.store {
                Store::Local(bq) => bq,
                Store::Replica(_) => {
                    let dl = q.dlx.is_some();
                    match self.replica_publish(vhost, qname, nm, confirm) {
                        Ok(owed) => {
                            sync = true;
                            pending += u32::from(owed);
                        }
                        Err(e) => {
                            // Cut off from the majority: the replica said so once.
                            if !matches!(e, warren_mirror::MirrorError::Isolated) {
                                tracing::warn!(queue = %qname, error = %e, "a mirrored queue refused a publish");
                            }
                            if let Some((conn, ch, cseq)) = confirm {
                                pending += 1;
                                nacks.push((conn, ch, cseq));
                            }
                        }
                    }
                    if dl
                        && let Some(q) = self
                            .vhosts
                            .get_mut(vhost)
                            .and_then(|v| v.queues.get_mut(qname))
                    {
                        q.dl_msgs.insert(id, (msg.meta.clone(), msg.body.clone()));
                    }
                    self.after_queue_op(vhost, qname);
                    continue;
                }
            };
            match bq.publish(self.now, nm) {
                Ok(p) => {
                    if p.needs_sync {
                        sync = true;
                        if let Some((conn, ch, cseq)) = confirm {
                            q.confirms.push_back((p.seq, conn, ch, cseq));
                            pending += 1;
                        }
                    }
                }
                Err(e) => {
                    tracing::error!(queue = %qname, error = %e, "publish failed");
                    return Err(err(
                        ReplyCode::InternalError,
                        format!("queue '{qname}' in vhost '{vhost}' failed to store a message"),
                    ));
                }
            }
            if q.dlx.is_some() {
                q.dl_msgs.insert(id, (msg.meta.clone(), msg.body.clone()));
            }
            self.after_queue_op(vhost, qname);
        }
        if sync {
            self.want_sync();
        }
        // Refused by a replica (not the master) or a full queue: nacked by
        // the caller once counted as pending.
        self.deferred_nacks.extend(nacks);
        if !self.dead.is_empty() {
            self.dead_letter();
        }
        Ok(pending)
    }

    fn conn(&mut self, id: ConnId) -> &mut Conn {
        self.conns.get_mut(&id).expect("connection present")
    }

    fn check(&self, id: ConnId, access: Access, kind: &str, name: &str) -> Result<(), AmqpError> {
        let c = &self.conns[&id];
        let ok = c.perm.as_ref().is_some_and(|p| p.allows(access, name));
        if ok {
            Ok(())
        } else {
            Err(err(
                ReplyCode::AccessRefused,
                format!(
                    "{} access to {kind} '{name}' in vhost '{}' refused for user '{}'",
                    access.as_str(),
                    c.vhost,
                    c.user
                ),
            ))
        }
    }

    /// The queue `name` if it exists and connection `id` may use it.
    fn usable_queue(&self, id: ConnId, name: &str) -> Result<(), AmqpError> {
        let vhost = &self.conns[&id].vhost;
        let q = self
            .vhosts
            .get(vhost)
            .and_then(|v| v.queues.get(name))
            .ok_or_else(|| AmqpError::queue_not_found(name, vhost))?;
        if let Some(owner) = q.owner
            && owner != id
        {
            return Err(locked(name, vhost));
        }
        Ok(())
    }

    /// The queue name of a method, or the channel's last declared queue when empty.
    fn queue_name(
        &self,
        id: ConnId,
        ch: ChannelId,
        name: &ShortString,
    ) -> Result<String, AmqpError> {
        if !name.as_str().is_empty() {
            return Ok(name.as_str().to_owned());
        }
        self.conns[&id]
            .channels
            .get(&ch)
            .and_then(|c| c.last_queue.clone())
            .ok_or_else(|| err(ReplyCode::NotFound, "no previously declared queue"))
    }

    fn command(&mut self, id: ConnId, ch: ChannelId, cmd: Command) -> Result<(), AmqpError> {
        if !self
            .conns
            .get(&id)
            .is_some_and(|c| c.channels.contains_key(&ch))
        {
            return Ok(());
        }
        match cmd {
            Command::BasicPublish(p) => {
                let c = self.conn(id);
                let chan = c.channels.get_mut(&ch).expect("channel present");
                if let Some(tx) = &mut chan.tx {
                    let mut p = p;
                    p.body = Bytes::copy_from_slice(&p.body);
                    tx.push(TxOp::Publish(Box::new(p)));
                    return Ok(());
                }
                self.publish(id, ch, p)
            }
            Command::BasicAck(a) => {
                if let Some(tx) = &mut self.conn(id).channels.get_mut(&ch).expect("channel").tx {
                    tx.push(TxOp::Ack(a));
                    return Ok(());
                }
                self.settle(id, ch, a.delivery_tag, a.multiple, Settle::Ack)
            }
            Command::BasicNack(n) => {
                if let Some(tx) = &mut self.conn(id).channels.get_mut(&ch).expect("channel").tx {
                    tx.push(TxOp::Nack(n));
                    return Ok(());
                }
                let how = if n.requeue {
                    Settle::Requeue
                } else {
                    Settle::Discard
                };
                self.settle(id, ch, n.delivery_tag, n.multiple, how)
            }
            Command::BasicReject(r) => {
                if let Some(tx) = &mut self.conn(id).channels.get_mut(&ch).expect("channel").tx {
                    tx.push(TxOp::Reject(r));
                    return Ok(());
                }
                let how = if r.requeue {
                    Settle::Requeue
                } else {
                    Settle::Discard
                };
                self.settle(id, ch, r.delivery_tag, false, how)
            }
            Command::ExchangeDeclare(d) => self.exchange_declare(id, ch, &d),
            Command::ExchangeDelete(d) => self.exchange_delete(id, ch, &d),
            Command::ExchangeBind(b) => {
                self.bind(
                    id,
                    b.source.as_str(),
                    Dest::Exchange(b.destination.as_str().to_owned()),
                    b.routing_key.as_str(),
                    &b.arguments,
                    true,
                )?;
                if !b.nowait {
                    self.conn(id).amqp.reply(ch, Reply::ExchangeBindOk);
                }
                Ok(())
            }
            Command::ExchangeUnbind(b) => {
                self.bind(
                    id,
                    b.source.as_str(),
                    Dest::Exchange(b.destination.as_str().to_owned()),
                    b.routing_key.as_str(),
                    &b.arguments,
                    false,
                )?;
                if !b.nowait {
                    self.conn(id).amqp.reply(ch, Reply::ExchangeUnbindOk);
                }
                Ok(())
            }
            Command::QueueDeclare(d) => self.queue_declare(id, ch, &d),
            Command::QueueBind(b) => {
                let q = self.queue_name(id, ch, &b.queue)?;
                let q = self.queue_arc(id, &q)?;
                self.bind(
                    id,
                    b.exchange.as_str(),
                    Dest::Queue(q),
                    b.routing_key.as_str(),
                    &b.arguments,
                    true,
                )?;
                if !b.nowait {
                    self.conn(id).amqp.reply(ch, Reply::QueueBindOk);
                }
                Ok(())
            }
            Command::QueueUnbind(b) => {
                let q = self.queue_name(id, ch, &b.queue)?;
                // A missing queue is no error for an unbind (`bind` below).
                let exists = self
                    .vhosts
                    .get(&self.conns[&id].vhost)
                    .is_some_and(|v| v.queues.contains_key(q.as_str()));
                let q = if exists {
                    self.queue_arc(id, &q)?
                } else {
                    Arc::from(q)
                };
                self.bind(
                    id,
                    b.exchange.as_str(),
                    Dest::Queue(q),
                    b.routing_key.as_str(),
                    &b.arguments,
                    false,
                )?;
                self.conn(id).amqp.reply(ch, Reply::QueueUnbindOk);
                Ok(())
            }
            Command::QueuePurge(p) => self.queue_purge(id, ch, &p),
            Command::QueueDelete(d) => self.queue_delete(id, ch, &d),
            Command::BasicQos(q) => {
                let c = self.conn(id);
                let chan = c.channels.get_mut(&ch).expect("channel present");
                if q.global {
                    chan.global_prefetch = q.prefetch_count;
                } else {
                    chan.prefetch = q.prefetch_count;
                }
                c.amqp.reply(ch, Reply::BasicQosOk);
                self.redrive_channel(id, ch);
                Ok(())
            }
            Command::BasicConsume(c) => self.consume(id, ch, &c),
            Command::BasicCancel(c) => {
                self.cancel(id, ch, c.consumer_tag.as_str());
                if !c.nowait {
                    self.conn(id).amqp.reply(
                        ch,
                        Reply::BasicCancelOk {
                            consumer_tag: c.consumer_tag.as_str().to_owned(),
                        },
                    );
                }
                Ok(())
            }
            Command::BasicGet(g) => self.get(id, ch, &g),
            Command::BasicRecover(_) => {
                // recover-ok goes first, as RabbitMQ sends it: clients drop
                // what they prefetched when it arrives.
                self.conn(id).amqp.reply(ch, Reply::BasicRecoverOk);
                self.recover(id, ch);
                self.redrive_channel(id, ch);
                Ok(())
            }
            Command::BasicRecoverAsync(_) => {
                self.recover(id, ch);
                self.redrive_channel(id, ch);
                Ok(())
            }
            Command::ConfirmSelect(s) => {
                let c = self.conn(id);
                c.channels.get_mut(&ch).expect("channel present").confirm = true;
                if !s.nowait {
                    c.amqp.reply(ch, Reply::ConfirmSelectOk);
                }
                Ok(())
            }
            Command::TxSelect => {
                let c = self.conn(id);
                let chan = c.channels.get_mut(&ch).expect("channel present");
                if chan.tx.is_none() {
                    chan.tx = Some(Vec::new());
                }
                c.amqp.reply(ch, Reply::TxSelectOk);
                Ok(())
            }
            Command::TxCommit => {
                let c = self.conn(id);
                let chan = c.channels.get_mut(&ch).expect("channel present");
                let ops = chan.tx.replace(Vec::new()).unwrap_or_default();
                for op in ops {
                    match op {
                        TxOp::Publish(mut p) => {
                            p.confirm_seq = Some(TX_COMMIT);
                            self.publish(id, ch, *p)?;
                        }
                        TxOp::Ack(a) => {
                            self.settle(id, ch, a.delivery_tag, a.multiple, Settle::Ack)?
                        }
                        TxOp::Nack(n) => {
                            let how = if n.requeue {
                                Settle::Requeue
                            } else {
                                Settle::Discard
                            };
                            self.settle(id, ch, n.delivery_tag, n.multiple, how)?;
                        }
                        TxOp::Reject(r) => {
                            let how = if r.requeue {
                                Settle::Requeue
                            } else {
                                Settle::Discard
                            };
                            self.settle(id, ch, r.delivery_tag, false, how)?;
                        }
                    }
                }
                // Persistent messages on durable queues are on disk before
                // commit-ok: the group commit sends it (see `confirm_one`).
                let c = self.conn(id);
                if c.channels.get(&ch).is_none_or(|chan| chan.tx_wait == 0) {
                    c.amqp.reply(ch, Reply::TxCommitOk);
                }
                Ok(())
            }
            Command::TxRollback => {
                let c = self.conn(id);
                if let Some(chan) = c.channels.get_mut(&ch) {
                    chan.tx = Some(Vec::new());
                }
                c.amqp.reply(ch, Reply::TxRollbackOk);
                Ok(())
            }
            _ => Err(err(ReplyCode::NotImplemented, "method not implemented")),
        }
    }

    fn queue_arc(&self, id: ConnId, name: &str) -> Result<Arc<str>, AmqpError> {
        self.usable_queue(id, name)?;
        let vhost = &self.conns[&id].vhost;
        let v = &self.vhosts[vhost];
        Ok(v.queues
            .get_key_value(name)
            .expect("queue present")
            .0
            .clone())
    }

    fn publish(&mut self, id: ConnId, ch: ChannelId, p: Publish) -> Result<(), AmqpError> {
        self.conn(id).publisher = true;
        if self.alarmed() {
            // A resource alarm: this publisher is told, and its input waits.
            let reason = self.alarms.cluster().to_string();
            self.conn(id).amqp.block(&reason);
        }
        let vhost = self.conns[&id].vhost.clone();
        let ex = p.exchange.as_str();
        let perm_name = if ex.is_empty() { "amq.default" } else { ex };
        let mut targets = Vec::new();
        {
            let v = self
                .vhosts
                .get(&vhost)
                .ok_or_else(|| AmqpError::vhost_not_found(&vhost))?;
            if !ex.is_empty() {
                let x = v
                    .exchanges
                    .get(ex)
                    .ok_or_else(|| AmqpError::exchange_not_found(ex, &vhost))?;
                if x.internal {
                    return Err(err(
                        ReplyCode::AccessRefused,
                        format!("cannot publish to internal exchange '{ex}' in vhost '{vhost}'"),
                    ));
                }
            }
            self.check(id, Access::Write, "exchange", perm_name)?;
            route(
                v,
                ex,
                p.routing_key.as_str(),
                p.properties.headers().as_ref(),
                &mut targets,
            );
        }
        let persistent = p.properties.delivery_mode() == &Some(2);
        let expiration_ms = p
            .properties
            .expiration()
            .as_ref()
            .and_then(|e| e.as_str().parse::<u64>().ok());
        let msg = Msg {
            meta: encode_meta(ex, p.routing_key.as_str(), &p.properties),
            body: Bytes::copy_from_slice(&p.body),
            persistent,
            expiration_ms,
            priority: p.properties.priority().unwrap_or(0),
        };
        let confirm = p.confirm_seq.map(|s| (id, ch, s));
        let pending = self.enqueue(&vhost, &targets, &msg, confirm)?;
        let now = self.now;
        let c = self.conn(id);
        for t in &targets {
            if !c.targets.contains(t) {
                if c.targets.len() >= FLOW_TARGETS {
                    c.targets.remove(0);
                }
                c.targets.push(t.clone());
            }
        }
        if c.link.is_none() {
            let seq = p.confirm_seq.filter(|s| *s != TX_COMMIT);
            let (routed, mandatory) = (!targets.is_empty(), p.mandatory);
            c.count(ch, |n| n.count_publish(routed, mandatory, seq.is_some()));
            if let Some(seq) = seq
                && let Some(chan) = c.channels.get_mut(&ch)
            {
                chan.confirm_started.insert(seq, now);
            }
        }
        if targets.is_empty() && p.mandatory {
            c.amqp.send_content(
                ch,
                &ContentMethod::Return {
                    reply_code: 312,
                    reply_text: "NO_ROUTE",
                    exchange: ex,
                    routing_key: p.routing_key.as_str(),
                },
                &p.properties,
                &p.body,
            );
        }
        if p.confirm_seq == Some(TX_COMMIT) {
            if let Some(chan) = c.channels.get_mut(&ch) {
                chan.tx_wait += pending;
            }
        } else if let Some(seq) = p.confirm_seq
            && let Some(chan) = c.channels.get_mut(&ch)
        {
            chan.confirm_last = chan.confirm_last.max(seq);
            if pending > 0 {
                chan.confirm_pending.insert(seq, pending);
            }
            if !c.confirm_dirty.contains(&ch) {
                c.confirm_dirty.push(ch);
            }
        }
        for (conn, ch, cseq) in std::mem::take(&mut self.deferred_nacks) {
            nack_one(&mut self.conns, conn, ch, cseq);
        }
        Ok(())
    }

    fn settle(
        &mut self,
        id: ConnId,
        ch: ChannelId,
        tag: u64,
        multiple: bool,
        how: Settle,
    ) -> Result<(), AmqpError> {
        let c = self.conn(id);
        let vhost = c.vhost.clone();
        let Some(chan) = c.channels.get_mut(&ch) else {
            return Ok(());
        };
        let taken: Vec<(u64, Unacked)> = if multiple {
            if tag == 0 || tag == u64::MAX {
                std::mem::take(&mut chan.unacked).into_iter().collect()
            } else {
                let rest = chan.unacked.split_off(&(tag + 1));
                let upto = std::mem::replace(&mut chan.unacked, rest);
                if upto.is_empty() {
                    return Err(unknown_tag(tag));
                }
                upto.into_iter().collect()
            }
        } else {
            match chan.unacked.remove(&tag) {
                Some(u) => vec![(tag, u)],
                None => return Err(unknown_tag(tag)),
            }
        };
        if matches!(how, Settle::Ack) && c.link.is_none() {
            c.count(ch, |n| n.acknowledged += taken.len() as u64);
        }
        let mut touched: Vec<Arc<str>> = Vec::new();
        for (_, u) in taken {
            if let Some(node) = &u.remote {
                self.link_settle(node, &vhost, u.bq_tag, how);
                continue;
            }
            let Some(q) = self
                .vhosts
                .get_mut(&vhost)
                .and_then(|v| v.queues.get_mut(&u.queue))
            else {
                continue;
            };
            let res = match how {
                Settle::Ack => {
                    q.counters.acked += 1;
                    q.dl_msgs.remove(&u.msg_id);
                    q.store.ack(u.bq_tag)
                }
                Settle::Requeue => q.store.requeue(u.bq_tag),
                Settle::Discard => q.store.discard(u.bq_tag),
            };
            if let Err(e) = res {
                tracing::error!(queue = %u.queue, error = %e, "settling a delivery failed");
            }
            if let Some(t) = &u.consumer
                && let Some(cons) = q
                    .consumers
                    .iter_mut()
                    .find(|x| x.conn == id && x.channel == ch && &x.tag == t)
            {
                cons.unacked = cons.unacked.saturating_sub(1);
            }
            if touched.last() != Some(&u.queue) {
                touched.push(u.queue);
            }
        }
        touched.sort();
        touched.dedup();
        for q in touched {
            self.after_queue_op(&vhost, &q);
        }
        // A global prefetch frees room on every queue this channel consumes.
        if self.conns[&id]
            .channels
            .get(&ch)
            .is_some_and(|c| c.global_prefetch != 0)
        {
            self.redrive_channel(id, ch);
        }
        Ok(())
    }

    fn redrive_channel(&mut self, id: ConnId, ch: ChannelId) {
        let c = &self.conns[&id];
        let vhost = c.vhost.clone();
        let mut queues: Vec<Arc<str>> = c
            .channels
            .get(&ch)
            .map(|c| c.consumers.values().cloned().collect())
            .unwrap_or_default();
        queues.sort();
        queues.dedup();
        for q in queues {
            self.after_queue_op(&vhost, &q);
        }
    }

    fn recover(&mut self, id: ConnId, ch: ChannelId) {
        let c = self.conn(id);
        let vhost = c.vhost.clone();
        let Some(chan) = c.channels.get_mut(&ch) else {
            return;
        };
        let taken = std::mem::take(&mut chan.unacked);
        let mut touched = Vec::new();
        for u in taken.into_values() {
            if let Some(node) = &u.remote {
                self.link_settle(node, &vhost, u.bq_tag, Settle::Requeue);
                continue;
            }
            if let Some(q) = self
                .vhosts
                .get_mut(&vhost)
                .and_then(|v| v.queues.get_mut(&u.queue))
            {
                if let Err(e) = q.store.requeue(u.bq_tag) {
                    tracing::error!(queue = %u.queue, error = %e, "requeue failed");
                }
                if let Some(t) = &u.consumer
                    && let Some(cons) = q
                        .consumers
                        .iter_mut()
                        .find(|x| x.conn == id && x.channel == ch && &x.tag == t)
                {
                    cons.unacked = cons.unacked.saturating_sub(1);
                }
                touched.push(u.queue);
            }
        }
        touched.sort();
        touched.dedup();
        for q in touched {
            self.after_queue_op(&vhost, &q);
        }
    }

    fn exchange_declare(
        &mut self,
        id: ConnId,
        ch: ChannelId,
        d: &exchange::Declare,
    ) -> Result<(), AmqpError> {
        let vhost = self.conns[&id].vhost.clone();
        let name = d.exchange.as_str();
        if name.is_empty() {
            return Err(err(
                ReplyCode::AccessRefused,
                format!("operation not permitted on the default exchange in vhost '{vhost}'"),
            ));
        }
        let v = self
            .vhosts
            .get(&vhost)
            .ok_or_else(|| AmqpError::vhost_not_found(&vhost))?;
        if d.passive {
            if !v.exchanges.contains_key(name) {
                return Err(AmqpError::exchange_not_found(name, &vhost));
            }
        } else {
            if !v.exchanges.contains_key(name)
                && let Err(e) = check_name(name)
            {
                return Err(err(
                    ReplyCode::PreconditionFailed,
                    format!(
                        "exchange name '{}' in vhost '{}' is invalid: {e}",
                        shown(name),
                        shown(&vhost)
                    ),
                ));
            }
            // 406 on the channel, as RabbitMQ answers since 3.11 (3.10 closed
            // the connection with 503).
            let kind = Kind::parse(d.kind.as_str()).ok_or_else(|| {
                err(
                    ReplyCode::PreconditionFailed,
                    format!("unknown exchange type '{}'", shown(d.kind.as_str())),
                )
            })?;
            if let Some(x) = v.exchanges.get(name) {
                let neq = |arg: &str, got: String, cur: String| {
                    Err(inequivalent("exchange", arg, name, &vhost, &got, &cur))
                };
                if x.kind != kind {
                    return neq("type", kind.as_str().into(), x.kind.as_str().into());
                }
                if x.durable != d.durable {
                    return neq("durable", d.durable.to_string(), x.durable.to_string());
                }
                if x.auto_delete != d.auto_delete {
                    return neq(
                        "auto_delete",
                        d.auto_delete.to_string(),
                        x.auto_delete.to_string(),
                    );
                }
                if x.internal != d.internal {
                    return neq("internal", d.internal.to_string(), x.internal.to_string());
                }
                if let Some(k) = tables_equivalent(&x.arguments, &d.arguments) {
                    return neq(
                        &k,
                        routing::show_value(d.arguments.inner().get(k.as_str())),
                        routing::show_value(x.arguments.inner().get(k.as_str())),
                    );
                }
            } else {
                if name.starts_with("amq.") {
                    return Err(err(
                        ReplyCode::AccessRefused,
                        format!("exchange name '{name}' contains reserved prefix 'amq.*'"),
                    ));
                }
                self.check(id, Access::Configure, "exchange", name)?;
                self.record(
                    Scope::of_exchange(d.durable),
                    Change::PutExchange(ExchangeDef {
                        vhost: vhost.clone(),
                        name: name.to_owned(),
                        kind: kind.as_str().to_owned(),
                        durable: d.durable,
                        auto_delete: d.auto_delete,
                        internal: d.internal,
                        arguments: d.arguments.clone(),
                    }),
                )
                .map_err(meta_err)?;
                let v = self.vhosts.get_mut(&vhost).expect("vhost present");
                v.exchanges.insert(
                    name.to_owned(),
                    Exchange {
                        kind,
                        durable: d.durable,
                        auto_delete: d.auto_delete,
                        internal: d.internal,
                        arguments: d.arguments.clone(),
                        bindings: Vec::new(),
                    },
                );
            }
        }
        if !d.nowait {
            self.conn(id).amqp.reply(ch, Reply::ExchangeDeclareOk);
        }
        Ok(())
    }

    fn exchange_delete(
        &mut self,
        id: ConnId,
        ch: ChannelId,
        d: &exchange::Delete,
    ) -> Result<(), AmqpError> {
        let vhost = self.conns[&id].vhost.clone();
        let name = d.exchange.as_str();
        if name.is_empty() || name.starts_with("amq.") {
            return Err(err(
                ReplyCode::AccessRefused,
                format!("operation not permitted on exchange '{name}' in vhost '{vhost}'"),
            ));
        }
        let v = self
            .vhosts
            .get(&vhost)
            .ok_or_else(|| AmqpError::vhost_not_found(&vhost))?;
        if let Some(x) = v.exchanges.get(name) {
            self.check(id, Access::Configure, "exchange", name)?;
            if d.if_unused && !x.bindings.is_empty() {
                return Err(err(
                    ReplyCode::PreconditionFailed,
                    format!("exchange '{name}' in vhost '{vhost}' in use"),
                ));
            }
            self.remove_exchange(&vhost, name)?;
        }
        if !d.nowait {
            self.conn(id).amqp.reply(ch, Reply::ExchangeDeleteOk);
        }
        Ok(())
    }

    fn remove_exchange(&mut self, vhost: &str, name: &str) -> Result<(), AmqpError> {
        let Some(v) = self.vhosts.get_mut(vhost) else {
            return Ok(());
        };
        let Some(x) = v.exchanges.remove(name) else {
            return Ok(());
        };
        let dest = Dest::Exchange(name.to_owned());
        let mut emptied = Vec::new();
        for (xn, other) in &mut v.exchanges {
            let before = other.bindings.len();
            other.bindings.retain(|b| b.dest != dest);
            if other.auto_delete && before > 0 && other.bindings.is_empty() {
                emptied.push(xn.clone());
            }
        }
        self.record(
            Scope::of_exchange(x.durable),
            Change::DeleteExchange {
                vhost: vhost.to_owned(),
                name: name.to_owned(),
            },
        )
        .map_err(meta_err)?;
        for e in emptied {
            self.remove_exchange(vhost, &e)?;
        }
        Ok(())
    }

    fn bind(
        &mut self,
        id: ConnId,
        source: &str,
        dest: Dest,
        key: &str,
        args: &FieldTable,
        add: bool,
    ) -> Result<(), AmqpError> {
        let vhost = self.conns[&id].vhost.clone();
        if source.is_empty() {
            return Err(err(
                ReplyCode::AccessRefused,
                format!("operation not permitted on the default exchange in vhost '{vhost}'"),
            ));
        }
        let v = self
            .vhosts
            .get(&vhost)
            .ok_or_else(|| AmqpError::vhost_not_found(&vhost))?;
        if !add {
            // Unbinding is idempotent in RabbitMQ (3.10 too): a missing
            // source or destination is no error, once permissions allow it.
            let (dest_name, dest_kind, dest_there) = match &dest {
                Dest::Queue(q) => (&**q, "queue", v.queues.contains_key(q)),
                Dest::Exchange(e) => (e.as_str(), "exchange", v.exchanges.contains_key(e)),
            };
            if !dest_there || !v.exchanges.contains_key(source) {
                self.check(id, Access::Write, dest_kind, dest_name)?;
                self.check(id, Access::Read, "exchange", source)?;
                return Ok(());
            }
        }
        let (dest_name, dest_kind, dest_scope) = match &dest {
            Dest::Queue(q) => {
                let queue = v
                    .queues
                    .get(q)
                    .ok_or_else(|| AmqpError::queue_not_found(q, &vhost))?;
                (q.to_string(), "queue", Scope::of_queue(&queue.opts))
            }
            Dest::Exchange(e) => {
                if e.is_empty() {
                    return Err(err(
                        ReplyCode::AccessRefused,
                        format!(
                            "operation not permitted on the default exchange in vhost '{vhost}'"
                        ),
                    ));
                }
                let x = v
                    .exchanges
                    .get(e)
                    .ok_or_else(|| AmqpError::exchange_not_found(e, &vhost))?;
                (e.clone(), "exchange", Scope::of_exchange(x.durable))
            }
        };
        let src = v
            .exchanges
            .get(source)
            .ok_or_else(|| AmqpError::exchange_not_found(source, &vhost))?;
        let scope = Scope::of_exchange(src.durable).min(dest_scope);
        self.check(id, Access::Write, dest_kind, &dest_name)?;
        self.check(id, Access::Read, "exchange", source)?;
        let def = BindingDef {
            vhost: vhost.clone(),
            source: source.to_owned(),
            destination: dest_name,
            destination_is_exchange: matches!(dest, Dest::Exchange(_)),
            routing_key: key.to_owned(),
            arguments: args.clone(),
        };
        let v = self.vhosts.get_mut(&vhost).expect("vhost present");
        let x = v.exchanges.get_mut(source).expect("exchange present");
        let pos = x
            .bindings
            .iter()
            .position(|b| b.dest == dest && b.key == key && b.args == *args);
        if add {
            if pos.is_none() {
                x.bindings.push(Binding {
                    dest,
                    key: key.to_owned(),
                    args: args.clone(),
                });
                self.record(scope, Change::PutBinding(def))
                    .map_err(meta_err)?;
            }
        } else if let Some(pos) = pos {
            x.bindings.remove(pos);
            let gone = x.auto_delete && x.bindings.is_empty();
            self.record(scope, Change::DeleteBinding(def))
                .map_err(meta_err)?;
            if gone {
                self.remove_exchange(&vhost, source)?;
            }
        }
        Ok(())
    }

    fn queue_declare(
        &mut self,
        id: ConnId,
        ch: ChannelId,
        d: &queue::Declare,
    ) -> Result<(), AmqpError> {
        // An exclusive queue is never durable: RabbitMQ ignores the durable
        // flag of an exclusive declare, both to create and to compare.
        let exclusive_durable;
        let d = if d.exclusive && d.durable {
            exclusive_durable = queue::Declare {
                durable: false,
                ..d.clone()
            };
            &exclusive_durable
        } else {
            d
        };
        let vhost = self.conns[&id].vhost.clone();
        let mut name = d.queue.as_str().to_owned();
        if name.is_empty() {
            if d.passive {
                name = self.queue_name(id, ch, &d.queue)?;
            } else {
                name = random_name("amq.gen-");
            }
        }
        let v = self
            .vhosts
            .get(&vhost)
            .ok_or_else(|| AmqpError::vhost_not_found(&vhost))?;
        let exists = v.queues.contains_key(name.as_str());
        if d.passive || exists {
            let q = v
                .queues
                .get(name.as_str())
                .ok_or_else(|| AmqpError::queue_not_found(&name, &vhost))?;
            if let Some(owner) = q.owner
                && owner != id
            {
                return Err(locked(&name, &vhost));
            }
            if !d.passive {
                let neq = |arg: &str, got: String, cur: String| {
                    Err(inequivalent("queue", arg, &name, &vhost, &got, &cur))
                };
                // As RabbitMQ: exclusivity is checked first, and differing
                // is 405 (its owner being another, or none), not 406.
                if q.opts.exclusive != d.exclusive {
                    return Err(locked(&name, &vhost));
                }
                if q.opts.durable != d.durable {
                    return neq("durable", d.durable.to_string(), q.opts.durable.to_string());
                }
                if q.opts.auto_delete != d.auto_delete {
                    return neq(
                        "auto_delete",
                        d.auto_delete.to_string(),
                        q.opts.auto_delete.to_string(),
                    );
                }
                if let Some(k) = tables_equivalent(&q.opts.arguments, &d.arguments) {
                    return neq(
                        &k,
                        routing::show_value(d.arguments.inner().get(k.as_str())),
                        routing::show_value(q.opts.arguments.inner().get(k.as_str())),
                    );
                }
            }
        } else {
            if let Err(e) = check_name(&name) {
                return Err(err(
                    ReplyCode::PreconditionFailed,
                    format!(
                        "queue name '{}' in vhost '{}' is invalid: {e}",
                        shown(&name),
                        shown(&vhost)
                    ),
                ));
            }
            if name.starts_with("amq.") && !d.queue.as_str().is_empty() {
                return Err(err(
                    ReplyCode::AccessRefused,
                    format!("queue name '{name}' contains reserved prefix 'amq.*'"),
                ));
            }
            self.check(id, Access::Configure, "queue", &name)?;
            let args = queue_args(&d.arguments, &name, &vhost)?;
            if let Some(dlx) = &args.dlx {
                self.check(
                    id,
                    Access::Write,
                    "exchange",
                    if dlx.is_empty() { "amq.default" } else { dlx },
                )?;
            }
            let opts = QueueOpts {
                durable: d.durable,
                exclusive: d.exclusive,
                auto_delete: d.auto_delete,
                arguments: d.arguments.clone(),
            };
            let master = if d.exclusive {
                None
            } else {
                self.locate_master(&vhost, &name, args.locator)
            };
            self.record(
                Scope::of_queue(&opts),
                Change::PutQueue(QueueDef {
                    vhost: vhost.clone(),
                    name: name.clone(),
                    durable: d.durable,
                    master: master.clone(),
                    auto_delete: d.auto_delete,
                    arguments: d.arguments.clone(),
                }),
            )
            .map_err(meta_err)?;
            let owner = d.exclusive.then_some(id);
            let mut q = self
                .make_queue(&vhost, Arc::from(name.as_str()), opts, owner)
                .map_err(|e| err(ReplyCode::InternalError, e.to_string()))?;
            if let Some(m) = master {
                tracing::info!(%vhost, queue = %name, master = %m, "queue served by (its master locator's choice)");
                q.remote = Some(Elsewhere::Node(Arc::from(m.as_str())));
            }
            let v = self.vhosts.get_mut(&vhost).expect("vhost present");
            v.queues.insert(q.name.clone(), q);
        }
        let now = self.now;
        let v = self.vhosts.get_mut(&vhost).expect("vhost present");
        let q = v.queues.get_mut(name.as_str()).expect("queue present");
        q.last_used_ms = now;
        let s = q.store.stats();
        let reply = Reply::QueueDeclareOk {
            queue: name.clone(),
            message_count: u32::try_from(s.ready).unwrap_or(u32::MAX),
            consumer_count: q.consumers.len() as u32,
        };
        let remote = match &q.remote {
            Some(Elsewhere::Node(n)) => Some(n.clone()),
            _ => None,
        };
        let c = self.conn(id);
        if let Some(chan) = c.channels.get_mut(&ch) {
            chan.last_queue = Some(name.clone());
        }
        match remote {
            _ if d.nowait => {}
            // Served elsewhere: the counts are the master's.
            Some(node) => self.link_count(&node, (id, ch), &vhost, &name),
            None => {
                c.amqp.reply(ch, reply);
            }
        }
        Ok(())
    }

    fn queue_purge(
        &mut self,
        id: ConnId,
        ch: ChannelId,
        p: &queue::Purge,
    ) -> Result<(), AmqpError> {
        let name = self.queue_name(id, ch, &p.queue)?;
        self.usable_queue(id, &name)?;
        self.check(id, Access::Read, "queue", &name)?;
        let vhost = self.conns[&id].vhost.clone();
        // Messages still unacked somewhere keep their dead-letter copies.
        let mut unacked_ids = HashSet::new();
        for c in self.conns.values() {
            for chan in c.channels.values() {
                for u in chan.unacked.values() {
                    if &*u.queue == name.as_str() {
                        unacked_ids.insert(u.msg_id);
                    }
                }
            }
        }
        let q = self
            .vhosts
            .get_mut(&vhost)
            .and_then(|v| v.queues.get_mut(name.as_str()))
            .expect("queue present");
        let n = q
            .store
            .purge()
            .map_err(|e| err(ReplyCode::InternalError, e))?;
        q.dl_msgs.retain(|k, _| unacked_ids.contains(k));
        self.mirror_turn(&vhost, &name);
        if !p.nowait {
            self.conn(id).amqp.reply(
                ch,
                Reply::QueuePurgeOk {
                    message_count: u32::try_from(n).unwrap_or(u32::MAX),
                },
            );
        }
        Ok(())
    }

    fn queue_delete(
        &mut self,
        id: ConnId,
        ch: ChannelId,
        d: &queue::Delete,
    ) -> Result<(), AmqpError> {
        let name = self.queue_name(id, ch, &d.queue)?;
        let vhost = self.conns[&id].vhost.clone();
        let mut count = 0;
        let mut found = false;
        if let Some(q) = self
            .vhosts
            .get(&vhost)
            .and_then(|v| v.queues.get(name.as_str()))
        {
            if let Some(owner) = q.owner
                && owner != id
            {
                return Err(locked(&name, &vhost));
            }
            self.check(id, Access::Configure, "queue", &name)?;
            if d.if_unused && !q.consumers.is_empty() {
                return Err(err(
                    ReplyCode::PreconditionFailed,
                    format!("queue '{name}' in vhost '{vhost}' in use"),
                ));
            }
            if d.if_empty && q.store.stats().ready > 0 {
                return Err(err(
                    ReplyCode::PreconditionFailed,
                    format!("queue '{name}' in vhost '{vhost}' is not empty"),
                ));
            }
            count = u32::try_from(q.store.stats().ready).unwrap_or(u32::MAX);
            found = true;
        }
        // delete-ok first, then the basic.cancel of the queue's consumers
        // (this channel's too), in RabbitMQ's order.
        if !d.nowait {
            self.conn(id).amqp.reply(
                ch,
                Reply::QueueDeleteOk {
                    message_count: count,
                },
            );
        }
        if found {
            self.delete_queue(&vhost, &name);
        }
        Ok(())
    }

    /// Deletes a queue: cancels its consumers (server-sent basic.cancel),
    /// releases its pending confirms, removes its bindings and files.
    fn delete_queue(&mut self, vhost: &str, name: &str) -> u32 {
        let Some(v) = self.vhosts.get_mut(vhost) else {
            return 0;
        };
        let Some(q) = v.queues.remove(name) else {
            return 0;
        };
        let count = u32::try_from(q.store.stats().ready).unwrap_or(u32::MAX);
        let cur = self.current;
        let forwarded: Vec<(Elsewhere, u64)> = match &q.remote {
            Some(node) => q
                .consumers
                .iter()
                .map(|c| (node.clone(), c.remote_cid))
                .collect(),
            None => Vec::new(),
        };
        for c in &q.consumers {
            if let Some(conn) = self.conns.get_mut(&c.conn) {
                if let Some(chan) = conn.channels.get_mut(&c.channel) {
                    chan.consumers.remove(&c.tag);
                }
                conn.cancel_consumer(c.channel, &c.tag);
                conn.wake(cur, c.conn);
            }
        }
        let mut owed: Vec<(ConnId, ChannelId, u64)> = q
            .confirms
            .iter()
            .map(|&(_, conn, ch, cseq)| (conn, ch, cseq))
            .collect();
        if let Store::Replica(m) = &q.store {
            owed.extend(m.owed_confirms());
            m.wake_shell();
        }
        for (conn, ch, cseq) in owed {
            confirm_one(&mut self.conns, conn, ch, cseq);
            if let Some(c) = self.conns.get_mut(&conn) {
                c.wake(cur, conn);
            }
        }
        let dest = Dest::Queue(q.name.clone());
        let mut emptied = Vec::new();
        for (xn, x) in &mut v.exchanges {
            let before = x.bindings.len();
            x.bindings.retain(|b| b.dest != dest);
            if x.auto_delete && before > 0 && x.bindings.is_empty() {
                emptied.push(xn.clone());
            }
        }
        if let Err(e) = self.record(
            Scope::of_queue(&q.opts),
            Change::DeleteQueue {
                vhost: vhost.to_owned(),
                name: name.to_owned(),
            },
        ) {
            tracing::error!(error = %e, "could not record a queue deletion");
        }
        if let Some(dir) = &q.dir {
            drop(q.store);
            if let Err(e) = std::fs::remove_dir_all(dir)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(dir = %dir.display(), error = %e, "could not remove a deleted queue's files");
            }
        }
        for (node, cid) in forwarded {
            self.link_cancel(&node, vhost, cid);
        }
        for e in emptied {
            if let Err(e) = self.remove_exchange(vhost, &e) {
                tracing::error!(error = %e, "auto-delete of an exchange failed");
            }
        }
        count
    }

    fn consume(&mut self, id: ConnId, ch: ChannelId, c: &basic::Consume) -> Result<(), AmqpError> {
        let name = self.queue_name(id, ch, &c.queue)?;
        let qarc = self.queue_arc(id, &name)?;
        self.check(id, Access::Read, "queue", &name)?;
        let vhost = self.conns[&id].vhost.clone();
        let mut tag = c.consumer_tag.as_str().to_owned();
        if tag.is_empty() {
            tag = random_name("amq.ctag-");
        }
        let tag: Arc<str> = Arc::from(tag.as_str());
        let conn = &self.conns[&id];
        let chan = conn.channels.get(&ch).expect("channel present");
        if chan.consumers.contains_key(&tag) {
            return Err(err(
                ReplyCode::NotAllowed,
                format!("attempt to reuse consumer tag '{tag}'"),
            ));
        }
        let prefetch = chan.prefetch;
        let q = self
            .vhosts
            .get_mut(&vhost)
            .and_then(|v| v.queues.get_mut(&qarc))
            .expect("queue present");
        if (c.exclusive && !q.consumers.is_empty()) || q.consumers.iter().any(|x| x.exclusive) {
            return Err(err(
                ReplyCode::AccessRefused,
                format!("queue '{name}' in vhost '{vhost}' in exclusive use"),
            ));
        }
        let mut consumer = Consumer {
            tag: tag.clone(),
            conn: id,
            channel: ch,
            no_ack: c.no_ack,
            exclusive: c.exclusive,
            prefetch,
            unacked: 0,
            reserved: 0,
            remote_cid: 0,
            cancel_on_failover: matches!(
                c.arguments.inner().get("x-cancel-on-ha-failover"),
                Some(AMQPValue::Boolean(true))
            ),
        };
        if q.remote.is_some() {
            self.link_consume(&vhost, &qarc, &mut consumer);
        }
        let q = self
            .vhosts
            .get_mut(&vhost)
            .and_then(|v| v.queues.get_mut(&qarc))
            .expect("queue present");
        q.consumers.push(consumer);
        q.had_consumers = true;
        let conn = self.conn(id);
        conn.channels
            .get_mut(&ch)
            .expect("channel present")
            .consumers
            .insert(tag.clone(), qarc.clone());
        if !c.nowait {
            conn.amqp.reply(
                ch,
                Reply::BasicConsumeOk {
                    consumer_tag: tag.to_string(),
                },
            );
        }
        self.after_queue_op(&vhost, &qarc);
        Ok(())
    }

    fn cancel(&mut self, id: ConnId, ch: ChannelId, tag: &str) {
        let c = self.conn(id);
        let vhost = c.vhost.clone();
        let Some(qname) = c
            .channels
            .get_mut(&ch)
            .and_then(|chan| chan.consumers.remove(tag))
        else {
            return;
        };
        let mut forwarded = None;
        if let Some(q) = self
            .vhosts
            .get_mut(&vhost)
            .and_then(|v| v.queues.get_mut(&qname))
        {
            if let Some(x) = q
                .consumers
                .iter()
                .find(|x| x.conn == id && x.channel == ch && &*x.tag == tag)
                && let Some(node) = &q.remote
            {
                forwarded = Some((node.clone(), x.remote_cid));
            }
            q.consumers
                .retain(|x| !(x.conn == id && x.channel == ch && &*x.tag == tag));
            q.last_used_ms = self.now;
        }
        if let Some((node, cid)) = forwarded {
            self.link_cancel(&node, &vhost, cid);
        }
        self.auto_delete_if_unused(&vhost, &qname);
    }

    fn get(&mut self, id: ConnId, ch: ChannelId, g: &basic::Get) -> Result<(), AmqpError> {
        let name = self.queue_name(id, ch, &g.queue)?;
        let qarc = self.queue_arc(id, &name)?;
        self.check(id, Access::Read, "queue", &name)?;
        let vhost = self.conns[&id].vhost.clone();
        let now = self.now;
        let q = self
            .vhosts
            .get_mut(&vhost)
            .and_then(|v| v.queues.get_mut(&qarc))
            .expect("queue present");
        q.last_used_ms = now;
        if let Some(node) = q.remote.clone() {
            self.link_get(&node, (id, ch), &vhost, &qarc, g.no_ack);
            return Ok(());
        }
        let bq = match &mut q.store {
            Store::Local(bq) => bq,
            Store::Replica(m) => {
                if !m.fetch(now, FetchForArgs::get(id, ch, g.no_ack)) {
                    self.conn(id).send_get_empty(ch);
                }
                self.after_queue_op(&vhost, &qarc);
                return Ok(());
            }
        };
        let d = bq
            .fetch(now)
            .map_err(|e| err(ReplyCode::InternalError, e.to_string()))?;
        let Some(d) = d else {
            self.conn(id).send_get_empty(ch);
            self.after_queue_op(&vhost, &qarc);
            return Ok(());
        };
        q.counters.delivered += 1;
        q.counters.redelivered += u64::from(d.redelivered);
        if g.no_ack {
            if let Err(e) = bq.ack(d.tag) {
                tracing::error!(queue = %name, error = %e, "ack failed");
            }
            q.dl_msgs.remove(&d.id);
        }
        let remaining = u32::try_from(bq.stats().ready).unwrap_or(u32::MAX);
        let conn = self.conn(id);
        let chan = conn.channels.get_mut(&ch).expect("channel present");
        chan.next_tag += 1;
        let tag = chan.next_tag;
        if !g.no_ack {
            chan.unacked.insert(
                tag,
                Unacked {
                    queue: qarc.clone(),
                    bq_tag: d.tag,
                    consumer: None,
                    msg_id: d.id,
                    remote: None,
                },
            );
        }
        let m = decode_meta(&d.props);
        conn.send_message(
            ch,
            &ContentMethod::GetOk {
                delivery_tag: tag,
                redelivered: d.redelivered,
                exchange: m.exchange,
                routing_key: m.routing_key,
                message_count: remaining,
            },
            &m.properties,
            &d.props,
            &d.body,
        );
        self.after_queue_op(&vhost, &qarc);
        Ok(())
    }
}

#[derive(Debug, Clone, Copy)]
enum Settle {
    Ack,
    Requeue,
    Discard,
}

fn strip_expiration(p: BasicProperties) -> BasicProperties {
    let mut out = BasicProperties::default();
    if let Some(v) = p.content_type() {
        out = out.with_content_type(v.clone());
    }
    if let Some(v) = p.content_encoding() {
        out = out.with_content_encoding(v.clone());
    }
    if let Some(v) = p.headers() {
        out = out.with_headers(v.clone());
    }
    if let Some(v) = p.delivery_mode() {
        out = out.with_delivery_mode(*v);
    }
    if let Some(v) = p.priority() {
        out = out.with_priority(*v);
    }
    if let Some(v) = p.correlation_id() {
        out = out.with_correlation_id(v.clone());
    }
    if let Some(v) = p.reply_to() {
        out = out.with_reply_to(v.clone());
    }
    if let Some(v) = p.message_id() {
        out = out.with_message_id(v.clone());
    }
    if let Some(v) = p.timestamp() {
        out = out.with_timestamp(*v);
    }
    if let Some(v) = p.kind() {
        out = out.with_type(v.clone());
    }
    if let Some(v) = p.user_id() {
        out = out.with_user_id(v.clone());
    }
    if let Some(v) = p.app_id() {
        out = out.with_app_id(v.clone());
    }
    if let Some(v) = p.cluster_id() {
        out = out.with_cluster_id(v.clone());
    }
    out
}

fn confirm_one(conns: &mut IdMap<ConnId, Conn>, conn: ConnId, ch: ChannelId, cseq: u64) {
    let Some(c) = conns.get_mut(&conn) else {
        return;
    };
    let Some(chan) = c.channels.get_mut(&ch) else {
        return;
    };
    if cseq == TX_COMMIT {
        chan.tx_wait = chan.tx_wait.saturating_sub(1);
        if chan.tx_wait == 0 {
            c.amqp.reply(ch, Reply::TxCommitOk);
        }
    } else if let Some(n) = chan.confirm_pending.get_mut(&cseq) {
        *n -= 1;
        if *n == 0 {
            chan.confirm_pending.remove(&cseq);
            if c.link_confirmed(cseq, true) {
                return;
            }
            if let Some(chan) = c.channels.get_mut(&ch) {
                chan.confirm_done.push(cseq);
            }
        }
    }
    if !c.confirm_dirty.contains(&ch) {
        c.confirm_dirty.push(ch);
    }
}

fn unknown_tag(tag: u64) -> AmqpError {
    err(
        ReplyCode::PreconditionFailed,
        format!("unknown delivery tag {tag}"),
    )
}

fn locked(name: &str, vhost: &str) -> AmqpError {
    err(
        ReplyCode::ResourceLocked,
        format!(
            "cannot obtain exclusive access to locked queue '{name}' in vhost '{vhost}'. It could be originally declared on another connection or the exclusive property value does not match that of the original declaration."
        ),
    )
}

/// Where a change to an entity is kept: exclusive queues (and bindings to
/// them) only here, transient entities shared through the cluster, durable
/// ones in the store. A binding is kept where its narrower end is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Scope {
    /// This node only.
    Local,
    /// Every node, until the cluster restarts (`MetadataStore::share`).
    Shared,
    /// Every node, across restarts (`MetadataStore::apply`).
    Durable,
}

impl Scope {
    fn of_queue(opts: &QueueOpts) -> Self {
        match (opts.exclusive, opts.durable) {
            (true, _) => Self::Local,
            (false, false) => Self::Shared,
            (false, true) => Self::Durable,
        }
    }

    fn of_exchange(durable: bool) -> Self {
        if durable { Self::Durable } else { Self::Shared }
    }
}

impl Broker {
    /// Where a new queue's master goes, if a `queue-master-locator` (the
    /// argument, else the policy's; `client-local` without either) picks
    /// another node of the cluster than this one.
    fn locate_master(&self, vhost: &str, name: &str, arg: Option<MasterLocator>) -> Option<String> {
        let policy = self.queue_policy(vhost, name, false);
        let locator = arg
            .or(policy.queue_master_locator)
            .unwrap_or(MasterLocator::ClientLocal);
        if locator == MasterLocator::ClientLocal {
            return None;
        }
        let candidates = self.meta.master_candidates()?;
        let running: Vec<String> = candidates.iter().map(|(n, _)| n.clone()).collect();
        let chosen = warren_policy::locate_master(
            locator,
            &warren_policy::LocateInput {
                client_node: &self.cfg.node_name,
                exclusive: false,
                mode: policy.ha.as_ref().map(|h| &h.mode),
                running_nodes: &running,
                masters_per_node: &candidates,
                seed: rand::random(),
            },
        );
        (chosen != self.cfg.node_name).then_some(chosen)
    }

    /// Records `change` where `scope` says.
    fn record(&mut self, scope: Scope, change: Change) -> Result<(), crate::meta::MetaError> {
        match scope {
            Scope::Local => Ok(()),
            Scope::Shared => self.meta.share(change),
            Scope::Durable => self.meta.apply(change),
        }
    }
}

/// A gap between two [`Broker::tick`]s longer than this (they run every
/// 50 ms) is a stall.
const STALL_MS: u64 = 250;

fn meta_err(e: crate::meta::MetaError) -> AmqpError {
    tracing::error!(error = %e, "metadata store failed");
    match e {
        // Why the cluster refused (no majority, a timeout) is the client's
        // to know: it tells it to try another node.
        crate::meta::MetaError::Cluster(_) => err(ReplyCode::InternalError, e.to_string()),
        // A local file's path and error stay in the node's log.
        _ => err(ReplyCode::InternalError, "metadata store failed"),
    }
}

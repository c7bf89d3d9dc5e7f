//! The broker: vhosts, exchanges, queues, connections and channels, driven
//! by the AMQP connection state machines it owns.
//!
//! This file holds [`Broker`] itself (opening and recovery, vhosts, users,
//! permissions); the rest is split by responsibility, each child module
//! adding its own `impl Broker`:
//!
//! - `state`: the data types (vhosts, exchanges, queues, consumers,
//!   connections, channels, unacked deliveries, messages);
//! - `connection`: connect, input and output, timers, login, channel close,
//!   disconnect;
//! - `command`: the AMQP command dispatcher and the checks it shares;
//! - `commits`: metadata changes committed by the shell off the lock, the
//!   client's reply held until then;
//! - `topology`: declare, delete, bind, purge; master locator; where
//!   metadata changes are recorded;
//! - `args`: queue arguments and redeclare equivalence;
//! - `publish`: routing, enqueue, mandatory returns, publisher confirms;
//! - `dispatch`: deliveries to consumers, consume, cancel, get, settle;
//! - `persistence`: the durable queues' logs and group commits;
//! - `dead_letter`: the tick (message and queue expiry) and dead-lettering;
//! - `mirrored`, `link`, `alarm`, `stats`, `policies`, `introspect`:
//!   mirrored queues, forwarding to other nodes, resource alarms, counters,
//!   policies, and what the management API shows.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use rand::RngCore as _;
use warren_amqp::{AmqpError, ChannelId, Config, ReplyCode};
use warren_backing_queue::{FsStorage, Journal, Storage};

use crate::BrokerError;
use crate::auth::{self, PermissionDef, UserDef};
use crate::meta::{Change, MetadataStore};
use crate::names::{check_name, shown};
use crate::routing::Kind;

pub(crate) mod alarm;
mod args;
mod bindings;
mod command;
mod commits;
mod connection;
mod dead_letter;
mod dispatch;
pub(crate) mod introspect;
pub(crate) mod link;
pub(crate) mod mirrored;
mod moving;
mod parked;
mod persistence;
pub(crate) mod policies;
mod publish;
mod reply_to;
mod state;
pub(crate) mod stats;
mod topology;

pub use args::QUEUE_RESIDENT_MAX;
pub use commits::{CommitDone, MetaCommit};
pub use moving::Moving;
pub use persistence::{Reopen, SyncBatch};
pub use state::Departed;

// The items the child modules share, by the names they use (`super::…`).
use args::{QueueArgs, RejectPublish, queue_args};
use dispatch::{Settle, drive_replica};
use link::Elsewhere;
use mirrored::{FetchForArgs, Store, nack_one};
use publish::confirm_one;
use state::{
    Binding, Channel, Conn, Consumer, DeadLetter, Dest, Exchange, IdMap, Msg, Queue, QueueOpts,
    Unacked, Vhost,
};
use topology::{Scope, new_vhost};

/// Identifies one client connection.
pub type ConnId = u64;

/// The owner of an exclusive queue that a connection of another node
/// declared: no connection of this node is it.
const OWNER_ELSEWHERE: ConnId = ConnId::MAX;

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

/// A queue whose consumers took (or acked) a message within [`FLOW_ACTIVE_MS`] holds
/// back its publishers while more than this many messages are ready, so
/// that consumers keep pace with what is accepted (RabbitMQ's credit flow
/// has the same effect). Idle consumers hold nobody back: the queue then
/// grows as RabbitMQ's does. Small, because what it holds is latency: with
/// lapin (one frame per write, one ack per delivery, prefetch 200) 256
/// gave consume latency p50 17–24 ms and 17–18 k msg/s on one node where
/// 8,192 gave 325–494 ms and 13–15 k msg/s (docs/benchmarks.md).
pub const FLOW_READY_MAX: u64 = 256;
/// The same bound in body bytes, for large messages: 256 of 1 MiB would
/// be four times a queue's memory budget (`QUEUE_RESIDENT_MAX`), paged out
/// to disk on every replica while its consumers catch up.
pub const FLOW_READY_BYTES_MAX: u64 = 16 << 20;
/// See [`FLOW_READY_MAX`].
const FLOW_ACTIVE_MS: u64 = 1_000;
/// Deliveries a consumer that acks may trail what it was sent before it
/// gets no more until it catches up (`state::Pace`; one that acks in
/// batches, twice its largest batch if that is more). As small as
/// [`FLOW_READY_MAX`] for the same reason: what it holds is latency.
pub const CONSUMER_BEHIND_MAX: u64 = 256;
/// A consumer counts as acking while its last settlement is this recent
/// (`state::Pace`): one that stops, holding what it has, is sent messages
/// again as its prefetch allows after this long.
pub const CONSUMER_ACKING_MS: u64 = 100;
/// Queues remembered per publishing connection for flow control.
const FLOW_TARGETS: usize = 8;
/// How deep dead-lettering may chain within one operation.
const DEAD_LETTER_DEPTH: u8 = 8;
/// A new master (promoted, or pointed at this node) counts a queue used for
/// this long after its takeover before `x-expires` may delete it: the
/// consumers on other nodes re-register over their links only once those
/// nodes learn of the takeover, which under load takes more than a short
/// `x-expires` (RabbitMQ's channels re-consume at once).
const TAKEOVER_GRACE_MS: u64 = 5_000;

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
    /// RabbitMQ's `consumer_timeout` (ms): a channel holding a delivery
    /// unacknowledged for longer is closed with 406, and its deliveries go
    /// back to their queues.
    pub consumer_timeout_ms: u64,
    /// Group commits of many durable queues go through the node's journal
    /// (`<data_dir>/journal`): one append and one `fdatasync` instead of a
    /// sync of every queue's log (see `warren_backing_queue::Journal`).
    pub journal: bool,
    /// The first connection id this broker gives out: the shards of one
    /// node give out ids of their own (a node's management API lists them
    /// together).
    pub first_conn_id: ConnId,
    /// The other shards of this node, by node name: a client connection
    /// whose first queue is mastered on one of them moves there
    /// (`moving.rs`). Empty on an unsharded node.
    pub siblings: Vec<Arc<str>>,
}

/// RabbitMQ 3.10's default `consumer_timeout`: 30 minutes.
const CONSUMER_TIMEOUT_MS: u64 = 30 * 60 * 1000;

impl BrokerConfig {
    /// Defaults for a node keeping its data in `data_dir`.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            node_name: "warren@localhost".into(),
            amqp: Config::default(),
            storage: FsStorage::shared(),
            consumer_timeout_ms: CONSUMER_TIMEOUT_MS,
            journal: true,
            first_conn_id: 1,
            siblings: Vec::new(),
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
    /// When the tick last looked for deliveries past the consumer timeout.
    last_ack_check_ms: u64,
    current: ConnId,
    sync_waker: Option<Waker>,
    sync_wanted: bool,
    /// The queues whose logs said they have something to sync since they
    /// were last committed (`persistence::Unsynced`): a group commit looks
    /// at these alone, not at every queue of the node.
    unsynced: persistence::Unsynced,
    /// When the tick last checked that every log with something to sync is
    /// in `unsynced`.
    last_unsynced_check_ms: u64,
    /// When a commit nobody waits for was first put off
    /// (`persistence::LAZY_SYNC_MS`).
    lazy_sync_since: Option<u64>,
    dead: Vec<DeadLetter>,
    dl_depth: u8,
    /// This broker's publisher identity in mirrored queues' publish ids.
    publisher_id: u64,
    /// The next publish sequence number into a mirrored queue.
    next_publish: u64,
    /// Publishes a replica refused during `enqueue`, nacked after it.
    deferred_nacks: Vec<(ConnId, ChannelId, u64)>,
    /// Queues holding publishes until they have a master again
    /// ([`parked`]).
    parked_queues: HashSet<(String, Arc<str>)>,
    /// Queues whose publishes wait for those forwarded to their previous
    /// master ([`parked::OldMaster`]).
    old_master_waits: HashSet<(String, Arc<str>)>,
    /// Forwarding to and from other nodes.
    links: link::Links,
    /// Mirrored queues whose ring backlog is over the high-water mark:
    /// publishers wait (credit-based flow control, as RabbitMQ's).
    backlogged: HashSet<(String, Arc<str>)>,
    /// Durable queues served here whose log failed (a full or failing
    /// disk), with the uid of the declaration that failed: not served until
    /// the shell opens their logs again ([`Broker::failed_logs`]).
    failed_logs: HashMap<(String, Arc<str>), u64>,
    /// Resource alarms: publishers are blocked while one is in force.
    alarms: alarm::Alarms,
    /// The traffic counts of closed client connections.
    retired_counters: stats::MessageCounters,
    /// The confirm latencies of closed client connections.
    retired_latency: stats::LatencyHistogram,
    /// The group commits run so far.
    io: stats::IoStats,
    /// The stored policies, as applied to queues ([`Broker::apply_policies`]).
    policies: warren_policy::PolicySet,
    /// Metadata commits made off the lock, for clients that wait for them.
    commits: commits::Commits,
    /// The node's journal of group commits ([`BrokerConfig::journal`]).
    journal: Option<Arc<Journal>>,
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

/// Refuses a name AMQP could not carry (see [`names`](crate::names)).
pub(crate) fn valid_name(kind: &str, name: &str) -> Result<(), BrokerError> {
    check_name(name)
        .map_err(|e| BrokerError::Invalid(format!("{kind} name '{}' is invalid: {e}", shown(name))))
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
        // Before any queue's log opens: what the journal holds goes back
        // into their files first.
        let journal = if cfg.journal {
            let dir = cfg.data_dir.join(persistence::JOURNAL_DIR);
            let (journal, _) = Journal::open(Arc::clone(&cfg.storage), &dir)?;
            Some(journal)
        } else {
            None
        };
        let next_conn = cfg.first_conn_id.max(1);
        let mut b = Self {
            cfg,
            meta,
            users: HashMap::new(),
            vhosts: HashMap::new(),
            conns: IdMap::default(),
            next_conn,
            next_msg_id: 1,
            next_uid: 1,
            now: 0,
            last_tick_ms: 0,
            tick_stalled: false,
            last_ack_check_ms: 0,
            current: 0,
            sync_waker: None,
            sync_wanted: false,
            unsynced: persistence::Unsynced::default(),
            last_unsynced_check_ms: 0,
            lazy_sync_since: None,
            dead: Vec::new(),
            dl_depth: 0,
            publisher_id: rand::rng().next_u64(),
            next_publish: 1,
            deferred_nacks: Vec::new(),
            parked_queues: HashSet::new(),
            old_master_waits: HashSet::new(),
            links: link::Links::default(),
            backlogged: HashSet::new(),
            failed_logs: HashMap::new(),
            alarms: alarm::Alarms::default(),
            retired_counters: stats::MessageCounters::default(),
            retired_latency: stats::LatencyHistogram::default(),
            io: stats::IoStats::default(),
            policies: warren_policy::PolicySet::new(),
            commits: commits::Commits::default(),
            journal,
        };
        // Non-durable queues' logs (bodies paged out past their budget) are
        // of no use to a new run.
        let transient = b.cfg.data_dir.join(persistence::TRANSIENT_DIR);
        if let Err(e) = b.cfg.storage.remove_dir_all(&transient)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(dir = %transient.display(), error = %e, "could not clear the non-durable queues' logs");
        }
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
                    bindings: Default::default(),
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

    /// Adds a vhost (durably), with its built-in exchanges.
    pub fn add_vhost(&mut self, name: &str) -> Result<(), BrokerError> {
        if !self.vhosts.contains_key(name) {
            valid_name("vhost", name)?;
            self.store_change(Change::PutVhost(name.to_owned()))?;
            self.vhosts.insert(name.to_owned(), new_vhost());
        }
        Ok(())
    }

    /// Adds or replaces a user (durably).
    pub fn put_user(&mut self, user: UserDef) -> Result<(), BrokerError> {
        valid_name("user", &user.name)?;
        self.store_change(Change::PutUser(user.clone()))?;
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
        if !self.vhosts.contains_key(&p.vhost) {
            return Err(BrokerError::Invalid(format!("no vhost '{}'", p.vhost)));
        }
        self.store_change(Change::PutPermission(p.clone()))?;
        if let Some(v) = self.vhosts.get_mut(&p.vhost) {
            v.permissions.insert(p.user.clone(), p);
        }
        Ok(())
    }

    /// Sets the waker of the task that runs group commits, and wakes it
    /// at once if a commit is wanted already (work that came while the
    /// node started): `want_sync` wakes only when a commit becomes wanted.
    pub fn set_sync_waker(&mut self, waker: Waker) {
        if self.sync_wanted {
            waker();
        }
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
}

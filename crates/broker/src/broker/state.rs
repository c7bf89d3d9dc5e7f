//! The broker's data: vhosts, exchanges and their bindings, queues and
//! their consumers, client connections with their channels and unacked
//! deliveries, and the messages on their way into queues.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use warren_amqp::amq_protocol::protocol::basic;
use warren_amqp::amq_protocol::types::FieldTable;
use warren_amqp::{ChannelId, Connection, Publish};
use warren_backing_queue::{DropReason, Limits, SeqId};
use warren_mirror::{HeldPublishes, Holds, PublishId};

use super::args::RejectPublish;
use super::{ConnId, Elsewhere, Store, Waker, link, stats};
use crate::auth::{Permission, PermissionDef};
use crate::routing::Kind;

/// FxHash-style hasher for the server-chosen integer keys (connection and
/// channel ids): hashed on every message, and never chosen by clients to
/// collide.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct IdHasher(u64);

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

pub(super) type IdMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<IdHasher>>;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) enum Dest {
    Queue(Arc<str>),
    Exchange(String),
}

#[derive(Debug, Clone)]
pub(super) struct Binding {
    pub(super) dest: Dest,
    pub(super) key: String,
    pub(super) args: FieldTable,
}

#[derive(Debug)]
pub(super) struct Exchange {
    pub(super) kind: Kind,
    pub(super) durable: bool,
    pub(super) auto_delete: bool,
    pub(super) internal: bool,
    pub(super) arguments: FieldTable,
    pub(super) bindings: super::bindings::Bindings,
}

#[derive(Debug, Clone)]
pub(super) struct Consumer {
    pub(super) tag: Arc<str>,
    pub(super) conn: ConnId,
    pub(super) channel: ChannelId,
    pub(super) no_ack: bool,
    pub(super) exclusive: bool,
    pub(super) prefetch: u16,
    pub(super) unacked: u32,
    /// Fetches from a mirrored queue's replica not yet handed out.
    pub(super) reserved: u32,
    /// Its id at the queue's master when the queue is forwarded (0: none).
    pub(super) remote_cid: u64,
    /// `x-cancel-on-ha-failover`: cancelled when the queue's master changes.
    pub(super) cancel_on_failover: bool,
    /// `x-priority`: consumers of a higher priority get messages first while
    /// they have room under their prefetch (0 without the argument).
    pub(super) priority: i32,
    /// How far behind its deliveries its acks are.
    pub(super) pace: Pace,
}

/// How far a consumer's settlements (acks, nacks, rejects) trail what it was
/// sent: a client that acks each delivery as it gets to it, behind by more
/// than [`CONSUMER_BEHIND_MAX`](super::CONSUMER_BEHIND_MAX) deliveries, gets
/// no more until it catches up, whatever its prefetch, so that what it has
/// not reached stays ready in the queue and flow control holds its
/// publishers back (`Broker::lags`) instead of the backlog growing in the
/// client's memory (lapin with no prefetch limit: consumed 82 % of what was
/// confirmed, e2e p50 0.8 s and growing, docs/benchmarks.md). Only while it
/// settles ([`CONSUMER_ACKING_MS`](super::CONSUMER_ACKING_MS)): a client
/// that holds messages unacked is sent messages as its prefetch allows. A
/// client that acks in batches (one `multiple` ack every N deliveries,
/// PerfTest's `--multi-ack-every`) may trail by twice its largest batch:
/// held at 256 it never reached its next ack, and with batches of 1,000
/// (RabbitMQ's Java client, no prefetch limit) it waited 100 ms for each,
/// 6.5k msg/s against 77k with batches of 100 (docs/benchmarks.md).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Pace {
    /// Deliveries sent to it that await a settlement, counted: the `seq` of
    /// its latest [`Unacked`].
    sent: u64,
    /// The highest `seq` among its settled deliveries.
    settled_upto: u64,
    /// When its last settlement came (ms).
    settled_at_ms: u64,
    /// The most of its deliveries settled together (by one `basic.ack`,
    /// `basic.nack` or, forwarded, one link settlement).
    batch: u64,
}

impl Pace {
    /// Counts a delivery that awaits a settlement; returns its `seq`.
    pub(super) fn sent(&mut self) -> u64 {
        self.sent += 1;
        self.sent
    }

    /// Counts the settlement of delivery `seq` at `now_ms`, one of
    /// `together` settled at once.
    pub(super) fn settled(&mut self, seq: u64, now_ms: u64, together: u64) {
        self.settled_upto = self.settled_upto.max(seq);
        self.settled_at_ms = now_ms;
        self.batch = self.batch.max(together);
    }

    /// Whether the consumer settles, but more than `CONSUMER_BEHIND_MAX`
    /// deliveries (or twice its largest batch) behind what it was sent.
    pub(super) fn behind(&self, now_ms: u64) -> bool {
        let allowed = super::CONSUMER_BEHIND_MAX.max(2 * self.batch);
        self.sent.saturating_sub(self.settled_upto) > allowed
            && self.settled_at_ms != 0
            && now_ms.saturating_sub(self.settled_at_ms) < super::CONSUMER_ACKING_MS
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(super) struct QueueOpts {
    pub(super) durable: bool,
    pub(super) exclusive: bool,
    pub(super) auto_delete: bool,
    pub(super) arguments: FieldTable,
}

pub(super) struct Queue {
    pub(super) name: Arc<str>,
    pub(super) uid: u64,
    pub(super) opts: QueueOpts,
    pub(super) owner: Option<ConnId>,
    pub(super) store: Store,
    /// Where this queue is served when not on this node (forwarded).
    pub(super) remote: Option<Elsewhere>,
    /// This node's master replica handed the queue over: it is not served
    /// here until this node is made its master again.
    pub(super) handed_over: bool,
    /// Held (with `handed_over`) until its replica starts as master:
    /// [`super::Broker::hold_for_replica`].
    pub(super) held_for_replica: bool,
    /// The publishes its local copy holds, for a replica that starts here
    /// as master from it ([`warren_mirror::Replica::new_master`]): none
    /// for a new queue, a master's when its replica ended and its copy
    /// stayed; [`HeldPublishes::unknown`] when not known (recovered from
    /// disk).
    pub(super) kept_held: HeldPublishes,
    /// In the order they were registered.
    pub(super) consumers: Vec<Consumer>,
    pub(super) rr: usize,
    /// `x-single-active-consumer`: only one consumer gets messages.
    pub(super) single_active: bool,
    /// The active consumer of a single-active-consumer queue (channel,
    /// connection and tag); see [`Queue::active_consumer`].
    pub(super) active: Option<(ConnId, ChannelId, Arc<str>)>,
    pub(super) had_consumers: bool,
    /// A consumer of this node's left while the queue had no master
    /// (`Elsewhere::Nowhere`): its cancel reached no master, so the next
    /// one is told ([`LinkMsg::ConsumerLeft`](super::LinkMsg::ConsumerLeft)), or this
    /// node counts it once it serves the queue, for `auto-delete`.
    pub(super) consumer_left_unseen: bool,
    /// The node this node takes for the queue's master sent it work for the
    /// queue (a publish or a get), so that node has seen the master move and
    /// this one has not yet: until this node hears of the move, or the
    /// deadline (ms) passes, such work waits here as between masters instead
    /// of going back and forth between the two.
    pub(super) stale_master: Option<(Arc<str>, u64)>,
    /// A mirrored queue's master's node, whose link went down, and until
    /// when (ms) work for the queue waits here as between masters, unless
    /// a new master is named or the link is back first
    /// (`Broker::hold_for_master_down`).
    pub(super) master_down: Option<(Arc<str>, u64)>,
    /// The queue's previous master, while publishes forwarded to it before
    /// the master moved are not yet settled ([`super::parked::OldMaster`]).
    pub(super) old_master: Option<super::parked::OldMaster>,
    pub(super) dlx: Option<String>,
    pub(super) dlrk: Option<String>,
    pub(super) expires_ms: Option<u64>,
    /// `x-overflow: reject-publish[-dlx]`.
    pub(super) reject: Option<RejectPublish>,
    /// The limits last given to the store (arguments and policy).
    pub(super) limits: Limits,
    /// `x-max-priority`: a priority queue (an argument only, fixed at declare).
    pub(super) max_priority: Option<u8>,
    /// Lazy mode (`x-queue-mode`, `queue-mode`): bodies only on disk.
    pub(super) lazy: bool,
    /// When it last handed a message to a consumer (flow control: a queue
    /// whose consumers are taking messages holds its publishers back while
    /// its backlog is large).
    pub(super) delivered_at_ms: u64,
    /// When a consumer last settled one of its deliveries: consumers that
    /// ack, even while they get nothing (behind, [`Pace`]), are taking
    /// messages for flow control.
    pub(super) settled_at_ms: u64,
    /// A consumer was passed over for being behind ([`Pace::behind`]): the
    /// tick drives the queue again once it may no longer be.
    pub(super) paced: bool,
    /// When it was last used (`x-expires` counts from here); after a
    /// takeover, up to `TAKEOVER_GRACE_MS` ahead of the clock.
    pub(super) last_used_ms: u64,
    /// Publishes waiting for a group commit before they are confirmed:
    /// (queue seq, connection, channel, publish sequence number).
    pub(super) confirms: VecDeque<(SeqId, ConnId, ChannelId, u64)>,
    /// A durable queue's log directory.
    pub(super) dir: Option<PathBuf>,
    /// A non-durable queue's: where it pages bodies out past its budget.
    pub(super) spill_dir: Option<PathBuf>,
    /// Its traffic since this node started serving it.
    pub(super) counters: stats::QueueCounters,
    /// Its master's figures, when it is served on another node (asked for
    /// every second: `peek_masters`).
    pub(super) remote_figures: Option<link::QueueFigures>,
    /// Publishes held while it has no master ([`super::parked`]).
    pub(super) parked: super::parked::Parked,
}

impl Queue {
    /// Notes publish `sent` going into this queue's local store (served
    /// alone here, so that a replica started from it later knows it holds
    /// it: [`Queue::kept_held`]). False if it must be refused instead: sent
    /// again, and the store holds it already or cannot tell.
    pub(super) fn take_held(&mut self, sent: Sent) -> bool {
        let id = sent.id();
        if sent.again() && self.kept_held.holds(id) != Holds::No {
            return false;
        }
        self.kept_held.note(id);
        true
    }

    /// Notes that this queue refused publish `id` (full, with
    /// `x-overflow: reject-publish`): in its local store's record, or its
    /// master replica's, which tells its mirrors ([`HeldPublishes`]).
    /// Returns whether the replica has that to broadcast.
    pub(super) fn note_refused(&mut self, id: PublishId) -> bool {
        match &mut self.store {
            Store::Local(_) => {
                self.kept_held.refuse(id);
                false
            }
            Store::Replica(m) => {
                m.replica.publish_refused(id);
                true
            }
        }
    }

    /// Notes that one of this node's consumers left it: while the queue has
    /// no master, no master hears of the cancel, so the next one is told
    /// ([`Queue::consumer_left_unseen`]).
    pub(super) fn consumer_left(&mut self) {
        if matches!(self.remote, Some(Elsewhere::Nowhere)) {
            self.consumer_left_unseen = true;
        }
    }

    /// Whether it is exclusive to a connection of this node (not to one of
    /// another node's, `OWNER_ELSEWHERE`).
    pub(super) fn owned_here(&self) -> bool {
        self.owner.is_some_and(|o| o != super::OWNER_ELSEWHERE)
    }

    /// Registers consumer `c`. On a single-active-consumer queue the first
    /// consumer becomes the active one, as in RabbitMQ (whatever its
    /// priority).
    pub(super) fn add_consumer(&mut self, c: Consumer) {
        if self.single_active && self.active_consumer().is_none() {
            self.active = Some((c.conn, c.channel, c.tag.clone()));
        }
        self.consumers.push(c);
    }

    /// Why a new consumer (`exclusive` or not) is refused, as RabbitMQ
    /// says it (403): the queue has an exclusive consumer, or an exclusive
    /// one asks while it has consumers or is a single-active-consumer
    /// queue (RabbitMQ's `exclusive_consume_unavailable`).
    pub(super) fn refuses_consumer(&self, exclusive: bool, vhost: &str) -> Option<String> {
        ((exclusive && (!self.consumers.is_empty() || self.single_active))
            || self.consumers.iter().any(|x| x.exclusive))
        .then(|| format!("queue '{}' in vhost '{vhost}' in exclusive use", self.name))
    }

    /// The index of a single-active-consumer queue's active consumer. When
    /// the active one is gone (cancelled, its channel or connection
    /// closed), the next takes over: the highest `x-priority`, the earliest
    /// registered among equals (RabbitMQ's choice).
    pub(super) fn active_consumer(&mut self) -> Option<usize> {
        let i = self.active_index();
        self.active = i.map(|i| {
            let c = &self.consumers[i];
            (c.conn, c.channel, c.tag.clone())
        });
        i
    }

    /// What [`Queue::active_consumer`] returns, without recording it.
    pub(super) fn active_index(&self) -> Option<usize> {
        if let Some((conn, ch, tag)) = &self.active
            && let Some(i) = self
                .consumers
                .iter()
                .position(|c| c.conn == *conn && c.channel == *ch && c.tag == *tag)
        {
            return Some(i);
        }
        let mut next: Option<usize> = None;
        for (i, c) in self.consumers.iter().enumerate() {
            if next.is_none_or(|n| c.priority > self.consumers[n].priority) {
                next = Some(i);
            }
        }
        next
    }

    /// The settings a store of this queue is opened with.
    pub(super) fn queue_config(&self) -> warren_backing_queue::QueueConfig {
        warren_backing_queue::QueueConfig {
            limits: self.limits,
            record_ops: false,
            report_dropped: self.dlx.is_some(),
            max_priority: self.max_priority,
        }
    }

    /// This node's figures of the queue: its store's counts, its consumers here.
    pub(super) fn figures(&self) -> link::QueueFigures {
        let s = self.store.stats();
        link::QueueFigures {
            ready: s.ready,
            unacked: s.unacked,
            ready_bytes: s.ready_bytes,
            unacked_bytes: s.unacked_bytes,
            consumers: self.consumers.len() as u64,
        }
    }

    /// Logs that settling delivery `what` of this queue failed: an error,
    /// unless this node no longer serves the queue (its master was deposed
    /// here; the new master requeued the old master's deliveries, and their
    /// acks are void, as RabbitMQ's are).
    pub(super) fn settle_failed(&self, what: &str, e: &dyn fmt::Display) {
        if self.store.serves() {
            tracing::error!(queue = %self.name, error = %e, "{what} failed");
        } else {
            tracing::debug!(queue = %self.name, error = %e, "{what} of a former master's delivery: void");
        }
    }

    /// A message of this queue (in `vhost`) to dead-letter for `reason`;
    /// `None` without a dead-letter exchange.
    pub(super) fn dead_letter(
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
pub(super) struct Vhost {
    pub(super) exchanges: HashMap<String, Exchange>,
    pub(super) queues: HashMap<Arc<str>, Queue>,
    pub(super) permissions: HashMap<String, PermissionDef>,
}

#[derive(Debug, Clone)]
pub(super) struct Unacked {
    pub(super) queue: Arc<str>,
    pub(super) bq_tag: u64,
    pub(super) consumer: Option<Arc<str>>,
    /// Its consumer's count of deliveries at this one ([`Pace::sent`]; 0
    /// for a `basic.get`).
    pub(super) seq: u64,
    /// Where to settle a delivery from a forwarded queue.
    pub(super) remote: Option<Elsewhere>,
    /// When it was delivered (ms): unacked past the consumer timeout, its
    /// channel is closed.
    pub(super) delivered_at_ms: u64,
}

/// A delivery of a forwarded queue that a channel's global prefetch holds
/// back (see `Channel::held`).
#[derive(Debug)]
pub(super) struct Held {
    pub(super) tag: u64,
    pub(super) consumer: Arc<str>,
    pub(super) redelivered: bool,
    pub(super) meta: Bytes,
    pub(super) body: Bytes,
}

#[derive(Debug)]
pub(super) enum TxOp {
    Publish(Box<Publish>),
    Ack(basic::Ack),
    Nack(basic::Nack),
    Reject(basic::Reject),
}

#[derive(Debug, Default)]
pub(super) struct Channel {
    pub(super) next_tag: u64,
    pub(super) unacked: BTreeMap<u64, Unacked>,
    pub(super) consumers: HashMap<Arc<str>, Arc<str>>,
    pub(super) prefetch: u16,
    pub(super) global_prefetch: u16,
    /// Fetches from mirrored queues for its manual-ack consumers, not yet
    /// handed out: they count against its global prefetch with `unacked`.
    pub(super) fetching: u32,
    /// Deliveries of forwarded queues past its global prefetch, in `unacked`
    /// but not yet sent: each queue's master limits only its own
    /// consumers, so the one limit over all of them is kept here.
    pub(super) held: VecDeque<Held>,
    pub(super) confirm: bool,
    pub(super) confirm_pending: BTreeMap<u64, u32>,
    /// Publishes refused (`basic.nack`) not yet sent.
    pub(super) confirm_nacked: BTreeSet<u64>,
    pub(super) confirm_last: u64,
    /// Every publish up to here has been acked or nacked (`multiple`).
    pub(super) confirm_acked: u64,
    /// Publishes confirmed since the last flush, in no order.
    pub(super) confirm_done: Vec<u64>,
    /// When each confirm-mode publish not yet settled was read: sequence
    /// number to ms.
    pub(super) confirm_started: BTreeMap<u64, u64>,
    pub(super) tx: Option<Vec<TxOp>>,
    /// Group commits a tx.commit-ok waits for.
    pub(super) tx_wait: u32,
    /// A publish of the committing transaction was refused (its mirrored
    /// master went): the commit fails once the others are settled.
    pub(super) tx_failed: bool,
    pub(super) last_queue: Option<String>,
    /// Its direct reply-to consumer (`amq.rabbitmq.reply-to`).
    pub(super) reply_consumer: Option<super::reply_to::ReplyConsumer>,
    /// Its client traffic so far (`/api/channels`).
    pub(super) counters: stats::MessageCounters,
}

pub(super) struct Conn {
    pub(super) amqp: Connection,
    pub(super) peer: SocketAddr,
    /// The TLS version its client speaks (RabbitMQ's name: `tlsv1.3`); None
    /// over plain TCP.
    pub(super) tls: Option<&'static str>,
    pub(super) user: String,
    pub(super) vhost: String,
    pub(super) perm: Option<Permission>,
    pub(super) channels: IdMap<ChannelId, Channel>,
    pub(super) waker: Waker,
    pub(super) woken: bool,
    pub(super) out_pending: usize,
    pub(super) throttled: bool,
    pub(super) confirm_dirty: Vec<ChannelId>,
    pub(super) closed: bool,
    /// The client closed it (connection.close from the client).
    pub(super) client_closed: bool,
    /// Set for the internal connection of a forwarding link (master side).
    pub(super) link: Option<link::Link>,
    /// It has begun to publish (a basic.publish method arrived): flow
    /// control and resource alarms may hold its input back.
    pub(super) publisher: bool,
    /// Its first command naming a queue has been seen: it stays on this
    /// shard (or has moved here) for good (`moving.rs`).
    pub(super) placed: bool,
    /// The sibling shard it waits to be moved to.
    pub(super) moving: Option<Arc<str>>,
    /// The command set aside for after the move, handled first.
    pub(super) resume: Option<warren_amqp::Event>,
    /// Its client traffic so far.
    pub(super) counters: stats::MessageCounters,
    /// Its confirm latencies so far.
    pub(super) latency: stats::LatencyHistogram,
    /// Bytes read from and written to its socket.
    pub(super) octets: stats::Octets,
    /// The queues (of its vhost) this connection's publishes went to lately:
    /// it waits while one of them lags behind its consumers (flow control).
    pub(super) targets: Vec<Arc<str>>,
    /// Its last command waits for its metadata commit (`commits.rs`):
    /// nothing more of its input is handled meanwhile.
    pub(super) committing: Option<super::commits::Parked>,
    /// Its commands answered later: `basic.get`s (forwarded to the queue's
    /// master, or waiting for a mirrored queue's ring) and `queue.declare`s
    /// waiting for the master's counts. Nothing more of its input is
    /// handled meanwhile, so its replies keep the order of its commands
    /// (RabbitMQ's channel waits for these calls too).
    pub(super) replies_waiting: u32,
}

/// A client connection that has left the broker, with everything it owned.
/// Dropping it may free much memory (unfinished messages): drop it after the
/// broker's lock is released.
pub struct Departed(pub(super) Box<Conn>);

impl Departed {
    /// Whether the client ended the connection with connection.close: it
    /// may still be writing what it queued behind the close (its socket is
    /// best read to the end rather than reset).
    #[must_use]
    pub fn client_closed(&self) -> bool {
        self.0.client_closed
    }

    /// The departed connection's protocol state, to read what the client
    /// still sends after its close off the broker's lock (it answers a
    /// repeated connection.close, as RabbitMQ does).
    #[must_use]
    pub fn into_amqp(self) -> Connection {
        self.0.amqp
    }
}

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
    pub(super) fn wake(&mut self, current: ConnId, me: ConnId) {
        if self.link.is_some() {
            // A link's shell takes output from every link at once.
            (self.waker)();
        } else if me != current && !self.woken {
            self.woken = true;
            (self.waker)();
        }
    }
}

/// A message to put into queues.
#[derive(Debug, Clone)]
pub(super) struct Msg {
    pub(super) meta: Bytes,
    pub(super) body: Bytes,
    pub(super) persistent: bool,
    pub(super) expiration_ms: Option<u64>,
    /// The `priority` property (0 if absent).
    pub(super) priority: u8,
    /// Its identity for a mirrored queue's replicas, if it came over a
    /// forwarding link or is sent again (`None`: the queue's master names
    /// it when it takes it).
    pub(super) sent: Option<Sent>,
}

/// A publish's identity for a mirrored queue's replicas, which hold each
/// once ([`warren_mirror::Replica::publish`]): a forwarded publish is sent
/// again under it when its master's node goes down before confirming it,
/// so that the next master confirms it if it holds it already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Sent {
    /// A forwarding link brought it: its origin's link stream and id.
    ByLink {
        /// The identity.
        id: PublishId,
        /// Sent again, or passed on by a node that was not the master:
        /// the master may hold it already.
        again: bool,
    },
    /// This node forwarded it before, to a master whose node went down
    /// (or whose link was reset) before confirming it, when its client
    /// published it (`since_ms`): sent again under the same identity.
    Again {
        /// The identity it was forwarded under.
        id: PublishId,
        /// When the client published it.
        since_ms: u64,
    },
}

impl Sent {
    /// The identity.
    pub(super) fn id(self) -> PublishId {
        match self {
            Sent::ByLink { id, .. } | Sent::Again { id, .. } => id,
        }
    }

    /// Whether a master may hold it already (see [`Sent::ByLink`]).
    pub(super) fn again(self) -> bool {
        match self {
            Sent::ByLink { again, .. } => again,
            Sent::Again { .. } => true,
        }
    }
}

/// A message leaving a queue towards its dead-letter exchange.
#[derive(Debug)]
pub(super) struct DeadLetter {
    pub(super) vhost: String,
    pub(super) exchange: String,
    pub(super) routing_key: Option<String>,
    pub(super) queue: Arc<str>,
    pub(super) reason: DropReason,
    pub(super) meta: Bytes,
    pub(super) body: Bytes,
}

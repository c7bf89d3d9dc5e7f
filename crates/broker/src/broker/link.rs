//! Forwarding between nodes: any node serves any queue.
//!
//! A queue whose master is on another node is *forwarded*: publishes, consumes,
//! gets and settlements of this node's clients go to the master's broker as
//! [`LinkMsg`]s, and deliveries, confirms and get replies come back. The
//! master sees each (origin node, vhost) as one internal connection with one
//! channel: forwarded consumers are ordinary consumers of its queue (their
//! tags are the origin's consumer ids), forwarded publishes ordinary
//! publishes whose confirms go back to the origin. The shell carries the
//! messages ([`Broker::take_link_out`], [`Broker::link_input`]) and reports a
//! node that went down ([`Broker::link_down`]): the origin nacks what that
//! node had not confirmed and forgets its deliveries (the queue's next master
//! delivers them again, redelivered); the master requeues what the origin's
//! clients had not acked.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use warren_amqp::amq_protocol::protocol::basic;
use warren_amqp::{BasicProperties, ChannelId, Connection, ContentMethod, Reply, ReplyCode};
use warren_mirror::PublishId;

use super::state::{Held, Pace, Sent};
use super::{
    Broker, Channel, Conn, ConnId, Consumer, IdMap, Msg, Settle, Unacked, Waker, confirm_one, err,
    nack_one,
};
use crate::auth::{Permission, PermissionDef};
use crate::routing::decode_meta;

/// The prefetch a forwarded consumer asks its queue's master for: its own,
/// bounded by its channel's global prefetch too (what the master sends past
/// that waits at the origin, `Channel::held`, so no more than that).
fn forward_prefetch(conns: &IdMap<ConnId, Conn>, c: &Consumer) -> u16 {
    let global = conns
        .get(&c.conn)
        .and_then(|x| x.channels.get(&c.channel))
        .map_or(0, |ch| ch.global_prefetch);
    match (c.prefetch, global) {
        (0, g) | (g, 0) => g,
        (p, g) => p.min(g),
    }
}

/// The channel of a link's internal connection on the master.
const LINK_CHANNEL: ChannelId = 1;

/// A forwarded publish's count of confirms owed while it is enqueued
/// (`LinkMsg::Publish`): more than any publish owes.
const PROVISIONAL: u32 = u32::MAX;

/// The confirms owed on link connection `pc`'s channel, by publish id.
fn link_pending(
    conns: &mut IdMap<ConnId, Conn>,
    pc: ConnId,
) -> Option<&mut std::collections::BTreeMap<u64, u32>> {
    conns
        .get_mut(&pc)
        .and_then(|c| c.channels.get_mut(&LINK_CHANNEL))
        .map(|ch| &mut ch.confirm_pending)
}

/// Queues the confirm (`ack`) or nack of forwarded publish `id` on `out`:
/// with the ids of the message before it if that is of the same kind, so
/// that a batch of publishes is settled by one message (every forwarded
/// publish is, `Forwarded`).
fn push_settled(out: &mut Vec<LinkMsg>, ack: bool, id: u64) {
    match out.last_mut() {
        Some(LinkMsg::Confirmed { ids }) if ack => ids.push(id),
        Some(LinkMsg::Nacked { ids }) if !ack => ids.push(id),
        _ => out.push(if ack {
            LinkMsg::Confirmed { ids: vec![id] }
        } else {
            LinkMsg::Nacked { ids: vec![id] }
        }),
    }
}

/// A forwarded get's message: the master's tag, redelivered, meta, body,
/// messages left.
pub type GetReplyMsg = (u64, bool, Bytes, Bytes, u32);

/// One message between two nodes' brokers about a forwarded queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LinkMsg {
    /// The first message on every link connection (handled by the shell):
    /// the sender's process incarnation and its connection count to this
    /// node. A new incarnation, or a new connection of a known one, means the
    /// sender dropped its link state: the receiver drops its own
    /// ([`Broker::link_down`]) before going on.
    Hello {
        /// Random per process start.
        incarnation: u64,
        /// Counts the sender's connections to this node.
        session: u64,
        /// The receiver's own link into the sender as the sender last
        /// heard it: (incarnation, session). A restarted sender that names
        /// the receiver's current session got everything sent on it, so the
        /// receiver's forwarded work stands (`Broker::link_peer_restarted`).
        seen: Option<(u64, u64)>,
        /// The receiver's link into the sender as the sender had heard it
        /// when it last gave up its link state with the receiver:
        /// (incarnation, session), `(0, 0)` if it had heard none; `None`
        /// if it never gave up. Work the receiver sent on a later session
        /// of its own reached the sender after that, so it stands
        /// (`Broker::link_peer_gave_up`).
        gave_up: Option<(u64, u64)>,
    },
    /// The answer on every link connection (handled by the shell), sent
    /// back by the accepting node at once: its process incarnation. The
    /// dialer then knows its session reaches that run of the node, so when
    /// a restarted node's own hello overtakes this session's, the work
    /// forwarded on the session stands.
    Welcome {
        /// The acceptor's process incarnation.
        incarnation: u64,
    },
    /// Origin → master: a publish into `queue` (`id` names its confirm).
    Publish {
        /// The vhost.
        vhost: String,
        /// The queue.
        queue: String,
        /// The origin's id for this publish.
        id: u64,
        /// With `first`, its identity in a mirrored queue's replicas, which
        /// hold each once: the link stream it first went on (the origin's,
        /// for a publish passed on by a node that was not the master)...
        publisher: u64,
        /// ... and its id there (`None`: `id`). A publish whose master's
        /// node goes down before confirming it is sent again under the same
        /// identity.
        first: Option<u64>,
        /// Exchange, routing key and properties, encoded.
        meta: Bytes,
        /// The body.
        body: Bytes,
        /// `delivery-mode` 2.
        persistent: bool,
        /// Per-message TTL.
        expiration_ms: Option<u64>,
        /// The `priority` property (0 if absent).
        priority: u8,
    },
    /// Master → origin: these publishes are confirmed.
    Confirmed {
        /// Publish ids.
        ids: Vec<u64>,
    },
    /// Master → origin: these publishes will never be confirmed.
    Nacked {
        /// Publish ids.
        ids: Vec<u64>,
    },
    /// Origin → master: a consumer of `queue`.
    Consume {
        /// The vhost.
        vhost: String,
        /// The queue.
        queue: String,
        /// The origin's consumer id.
        cid: u64,
        /// Unacked deliveries allowed (0: no limit).
        prefetch: u16,
        /// Deliveries need no ack.
        no_ack: bool,
        /// Its `x-priority`.
        priority: i32,
        /// An exclusive consumer: the queue's only one.
        exclusive: bool,
    },
    /// A direct reply-to reply, to the node of the channel its routing key
    /// `to` names (`broker/reply_to.rs`).
    Reply {
        /// The routing key: `amq.rabbitmq.reply-to.` and the address.
        to: String,
        /// Exchange, routing key and properties, encoded.
        meta: Bytes,
        /// The body.
        body: Bytes,
    },
    /// Origin → master: the consumer is gone.
    Cancel {
        /// The vhost.
        vhost: String,
        /// The origin's consumer id.
        cid: u64,
    },
    /// Master → origin: consumer `cid` is cancelled; every delivery to it
    /// came before this.
    CancelOk {
        /// The origin's consumer id.
        cid: u64,
    },
    /// Origin → master: a consumer of `queue` at the origin left while the
    /// queue had no master, so no master heard of it: the master counts it
    /// (an `auto-delete` queue with no consumer left goes).
    ConsumerLeft {
        /// The vhost.
        vhost: String,
        /// The queue.
        queue: String,
    },
    /// Master → origin: a delivery to consumer `cid`.
    Deliver {
        /// The origin's consumer id.
        cid: u64,
        /// The master's delivery tag (settle with it).
        tag: u64,
        /// Delivered before.
        redelivered: bool,
        /// The queue's vhost: a delivery to a consumer the origin no longer
        /// knows goes back to it.
        vhost: String,
        /// Exchange, routing key and properties, encoded.
        meta: Bytes,
        /// The body.
        body: Bytes,
    },
    /// Master → origin: the consumer was cancelled (its queue was deleted).
    Cancelled {
        /// The origin's consumer id.
        cid: u64,
    },
    /// Origin → master: a `basic.get`.
    Get {
        /// The vhost.
        vhost: String,
        /// The queue.
        queue: String,
        /// The origin's request id.
        req: u64,
        /// The message needs no ack.
        no_ack: bool,
    },
    /// Master → origin: a get's answer (`None`: the queue was empty).
    GetReply {
        /// The origin's request id.
        req: u64,
        /// The message: master's tag, redelivered, meta, body, messages left.
        msg: Option<GetReplyMsg>,
    },
    /// Origin → master: settle these deliveries (0 ack, 1 requeue, 2 discard).
    Settle {
        /// The vhost.
        vhost: String,
        /// The master's delivery tags.
        tags: Vec<u64>,
        /// How.
        how: u8,
    },
    /// Any node → every other: the sender's resource alarms, repeated
    /// while one is set (RabbitMQ's alarms are cluster-wide: publishers on
    /// every node wait). An all-clear ends them at once; a node that stops
    /// repeating, or goes down, stops counting after a while.
    Alarms {
        /// The sender's memory alarm.
        memory: bool,
        /// The sender's disk alarm.
        disk: bool,
    },
    /// Origin → master: how many messages and consumers `queue` has (a
    /// client's `queue.declare` on the origin waits for the answer, so that
    /// its counts are the queue's, as on any RabbitMQ node).
    Count {
        /// The vhost.
        vhost: String,
        /// The queue.
        queue: String,
        /// The origin's request id.
        req: u64,
    },
    /// Master → origin: the answer to a [`LinkMsg::Count`].
    Counted {
        /// The origin's request id.
        req: u64,
        /// Ready messages.
        messages: u64,
        /// Consumers, of every node.
        consumers: u32,
    },
    /// Origin → master, every second: the figures of these queues (vhost,
    /// name), for what the origin's operators see. Not a use (x-expires).
    Peek {
        /// The queues this node forwards to the master.
        queues: Vec<(String, String)>,
    },
    /// Master → origin: the answer to a [`LinkMsg::Peek`].
    Peeked {
        /// The asked queues it serves (vhost, name), with their figures.
        counts: Vec<(String, String, QueueFigures)>,
    },
    /// Master → origin: consumer `cid` ([`LinkMsg::Consume`]) is one of
    /// the queue's consumers now. The client's `basic.consume-ok` waits for
    /// it, as RabbitMQ's channel waits for the queue's master: a consumer
    /// that a client was told about counts for auto-delete and exclusive
    /// use at once, on every node.
    ConsumeOk {
        /// The origin's consumer id.
        cid: u64,
    },
    /// Master → origin: consumer `cid` is refused (the queue is in
    /// exclusive use, or it asked to be exclusive and the queue has
    /// consumers): the client's channel is closed with 403, as on the
    /// master's node.
    ConsumeRefused {
        /// The origin's consumer id.
        cid: u64,
        /// The refusal's reply text.
        text: String,
    },
    /// Origin → master: a client's `queue.purge`; answered with
    /// [`LinkMsg::Counted`] (`messages`: how many it removed).
    Purge {
        /// The vhost.
        vhost: String,
        /// The queue.
        queue: String,
        /// The origin's request id.
        req: u64,
    },
    /// Master → origin, after each batch of link input with publishes in
    /// it: the origin's forwarded publishes up to id `upto` were taken in
    /// (enqueued, or refused), none of them held back any longer. The
    /// origin's publishers wait while more than [`LINK_PUBLISHES_MAX`] of
    /// its publishes to this node are not yet taken in, so that the node
    /// holding them back never stops reading the link, and the acks behind
    /// them on it get through.
    Taken {
        /// The id of the last publish taken in ([`LinkMsg::Publish`]'s `id`).
        upto: u64,
    },
}

/// A queue's figures as its master has them ([`LinkMsg::Peeked`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct QueueFigures {
    /// Ready messages.
    pub ready: u64,
    /// Delivered, not yet acknowledged.
    pub unacked: u64,
    /// Bytes of the ready messages.
    pub ready_bytes: u64,
    /// Bytes of the unacknowledged ones.
    pub unacked_bytes: u64,
    /// Consumers, of every node.
    pub consumers: u64,
}

/// How often a node asks the masters of the queues it forwards for their
/// figures.
const PEEK_EVERY_MS: u64 = 1_000;

/// The link state of a master-side internal connection.
#[derive(Debug)]
pub(crate) struct Link {
    node: String,
    out: Vec<LinkMsg>,
    gets: VecDeque<u64>,
}

impl Link {
    /// The origin node this internal connection serves.
    pub(crate) fn origin(&self) -> &str {
        &self.node
    }
}

/// The node whose forwarded work connection `conn` carries, if it is a
/// link's internal connection.
pub(super) fn link_origin(conns: &IdMap<ConnId, Conn>, conn: ConnId) -> Option<&str> {
    conns.get(&conn)?.link.as_ref().map(Link::origin)
}

/// A consumer of a forwarded queue, on the origin.
#[derive(Debug, Clone)]
pub(crate) struct RemoteConsumer {
    conn: ConnId,
    channel: ChannelId,
    tag: Arc<str>,
    vhost: String,
    queue: Arc<str>,
    no_ack: bool,
}

/// A forwarded `basic.get` waiting for its answer.
#[derive(Debug)]
struct RemoteGet {
    /// The master's node.
    node: Arc<str>,
    conn: ConnId,
    channel: ChannelId,
    no_ack: bool,
    vhost: String,
    queue: Arc<str>,
    /// When `conn` is another node's link: the request of that node's get,
    /// which this one forwards on (the master moved on from here).
    req: Option<u64>,
    /// When it was asked.
    since_ms: u64,
}

/// A client's `queue.declare` waiting for the master's counts.
#[derive(Debug)]
struct PendingCount {
    /// The client's command that waits.
    what: Asked,
    node: Arc<str>,
    conn: ConnId,
    channel: ChannelId,
    vhost: String,
    queue: String,
    /// When it was asked: unanswered after [`COUNT_WAIT_MS`], this node's
    /// own counts answer it.
    since_ms: u64,
}

/// A client's command on a queue served by another node that waits for
/// the master's figures ([`PendingCount`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Asked {
    /// `queue.declare`: answered with the master's counts.
    Declare,
    /// `queue.purge`: the master purges, and says how many went.
    Purge,
    /// `queue.delete`: its conditions checked against the master's counts
    /// (every node's consumers), then the delete is made here, answered
    /// with the master's count.
    Delete {
        /// Refused while the queue has consumers.
        if_unused: bool,
        /// Refused while the queue has ready messages.
        if_empty: bool,
    },
}

impl PendingCount {
    /// What asks the master for it, as request `req`.
    fn ask(&self, req: u64) -> LinkMsg {
        let (vhost, queue) = (self.vhost.clone(), self.queue.clone());
        if self.what == Asked::Purge {
            LinkMsg::Purge { vhost, queue, req }
        } else {
            LinkMsg::Count { vhost, queue, req }
        }
    }
}

/// How long a declare waits for its master's counts across link resets
/// before this node's own copy answers, and a consume for its master's
/// [`LinkMsg::ConsumeOk`] before its consume-ok goes anyway.
const COUNT_WAIT_MS: u64 = 5_000;

/// How long work from the node this node takes for a queue's master waits
/// for this node to hear of the move (`Broker::note_stale_master`): the
/// metadata reaches every node within milliseconds, and if this node was
/// right after all, the work goes to that node then.
const STALE_MASTER_MS: u64 = 250;

/// The node a declare held for a queue's next master waits on
/// ([`Broker::hold_count`]): none yet.
const NO_MASTER: &str = "";

/// A client's `basic.consume` of a forwarded queue whose `consume-ok`
/// waits for the master's [`LinkMsg::ConsumeOk`].
#[derive(Debug)]
struct PendingConsumeOk {
    conn: ConnId,
    channel: ChannelId,
    tag: Arc<str>,
    /// When it was asked: unanswered after [`COUNT_WAIT_MS`] (the master
    /// stays unreachable), it is answered anyway; the consumer is asked
    /// for again when a master is reachable (`resubscribe`).
    since_ms: u64,
}

/// A client's `basic.cancel` of a forwarded consumer whose `cancel-ok`
/// waits for the master's [`LinkMsg::CancelOk`]: deliveries the master
/// sent before it still reach the client, as RabbitMQ's channel delivers
/// what its queue sent before the cancel.
#[derive(Debug)]
struct PendingCancelOk {
    /// The master's node.
    node: Arc<str>,
    conn: ConnId,
    channel: ChannelId,
    tag: Arc<str>,
    /// When it was asked: answered anyway after [`COUNT_WAIT_MS`].
    since_ms: u64,
}

/// Messages for one node, waiting to be written to its link, past which
/// the publishers that send through that link wait (flow control): the
/// node does not read its link as fast as this node writes to it.
pub const LINK_BEHIND_MAX: usize = 8_192;

/// Publishes forwarded to one node and not yet taken in there
/// ([`LinkMsg::Taken`]), past which the publishers that send through that
/// link wait (flow control): the node holds forwarded publishes back while
/// their queue falls behind, and stops reading the link if 4,096 are held
/// (the node shell's `HELD_MAX`); kept under that, the link stays read, and
/// the acks of this node's consumers, behind those publishes on it, reach
/// the queue's master at once (they are what lets it deliver more).
pub const LINK_PUBLISHES_MAX: usize = 2_048;

/// The origin's side of forwarding.
#[derive(Default)]
pub(crate) struct Links {
    /// Messages for each node.
    out: HashMap<String, Vec<LinkMsg>>,
    /// Messages handed to the shell for each node ([`Broker::take_link_out`])
    /// and not yet written or given up ([`Broker::link_sent`]).
    unsent: HashMap<String, usize>,
    /// Forwarded publishes awaiting their master's confirm, by id.
    publishes: IdMap<u64, Forwarded>,
    /// The link stream of each node's current link session: a publish's
    /// identity in a mirrored queue is its stream and id
    /// ([`LinkMsg::Publish`]). A new session starts a new stream, so that
    /// a master sees each stream's publishes in order, once.
    streams: HashMap<String, u64>,
    /// The ids of the publishes forwarded to each node and not yet taken in
    /// there ([`LinkMsg::Taken`]), in the order they were sent.
    in_flight: HashMap<String, VecDeque<u64>>,
    next_id: u64,
    /// Forwarded consumers by id.
    consumers: IdMap<u64, RemoteConsumer>,
    /// Per node: the ids below this were given before its link was last
    /// reset, when its consumers here got new ones (`renumber_consumers`).
    retired_below: HashMap<String, u64>,
    /// Forwarded gets by request id.
    gets: IdMap<u64, RemoteGet>,
    /// Declares waiting for their queue's counts, by request id.
    counts: IdMap<u64, PendingCount>,
    /// Consumes waiting for their master's [`LinkMsg::ConsumeOk`], by
    /// consumer id.
    consume_oks: IdMap<u64, PendingConsumeOk>,
    /// Cancels waiting for the master's [`LinkMsg::CancelOk`], by consumer id.
    cancel_oks: IdMap<u64, PendingCancelOk>,
    /// When the masters were last asked for their queues' figures.
    peeked_at_ms: u64,
    /// Master-side internal connections by (origin node, vhost).
    conns: HashMap<(String, String), ConnId>,
    waker: Option<Waker>,
}

/// A publish forwarded to a queue's master and not yet confirmed by it:
/// whose confirm it owes, and what to send again if the master's node goes
/// down first (`Broker::drop_origin_state`). Every forwarded publish is one,
/// with a confirm or not: the master confirms each to the origin, so that
/// the origin knows which reached the queue (a publish without one is sent
/// again like the others, and those after it wait for it when the master
/// moves, `parked::OldMaster`), as RabbitMQ's channels give every publish
/// to the queue's mirrors too.
#[derive(Debug)]
pub(super) struct Forwarded {
    /// The master's node.
    node: Arc<str>,
    /// The client's confirm (connection, channel, publish sequence
    /// number), if it asked for one.
    owed: Option<(ConnId, ChannelId, u64)>,
    /// Its identity in the queue's replicas ([`LinkMsg::Publish`]).
    identity: PublishId,
    vhost: String,
    queue: Arc<str>,
    msg: Msg,
    /// When the client published it.
    since_ms: u64,
}

/// How long after its client published it a forwarded publish whose
/// master's node went down waits for the queue's next master (or the link
/// back) before it is nacked; and a publish that comes meanwhile. RabbitMQ's
/// publishers see no nack when a master dies (its mirrors have every
/// publish from the channel too); the bound keeps a publisher cut off from
/// a master that is not replaced answered within the failure timeout.
pub(super) const RESEND_WAIT_MS: u64 = 3_000;

/// Where a queue that this node does not serve is served, and where a
/// delivery from such a queue is settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Elsewhere {
    /// The node of the queue's master: work is forwarded there.
    Node(Arc<str>),
    /// No node, right now: the master handed the queue over or its node went
    /// down, and no new master is known yet. Publishes are held for the next
    /// master (`parked`), gets come back empty, consumers wait for a master,
    /// and settlements are dropped (the next master delivers again).
    Nowhere,
}

impl Elsewhere {
    /// Whether this is node `node`.
    fn is(&self, node: &str) -> bool {
        matches!(self, Elsewhere::Node(n) if &**n == node)
    }

    /// The node, if there is one.
    pub(crate) fn node(&self) -> Option<&Arc<str>> {
        match self {
            Elsewhere::Node(n) => Some(n),
            Elsewhere::Nowhere => None,
        }
    }
}

impl Links {
    /// Whether a declare or a get of queue `name` waits for its next master
    /// (`hold_count`, `link_get`).
    pub(super) fn wait_for_master(&self, vhost: &str, name: &str) -> bool {
        self.gets
            .values()
            .any(|g| &*g.node == NO_MASTER && g.vhost == vhost && &*g.queue == name)
            || self
                .counts
                .values()
                .any(|p| &*p.node == NO_MASTER && p.vhost == vhost && p.queue == name)
    }
    pub(super) fn send(&mut self, node: &str, msg: LinkMsg) {
        self.out.entry(node.to_owned()).or_default().push(msg);
        self.wake();
    }

    /// Tells `node` that its forwarded publish `id` is confirmed (`ack`) or
    /// nacked.
    pub(super) fn settle(&mut self, node: &str, ack: bool, id: u64) {
        push_settled(self.out.entry(node.to_owned()).or_default(), ack, id);
        self.wake();
    }

    /// Wakes the shell task that carries link messages, once it is set.
    fn wake(&self) {
        if let Some(w) = &self.waker {
            w();
        }
    }

    /// Sends to where a queue is served; nothing while it is served nowhere
    /// (its consumers wait for a master).
    fn send_to(&mut self, to: &Elsewhere, msg: LinkMsg) {
        if let Elsewhere::Node(node) = to {
            self.send(node, msg);
        }
    }

    pub(super) fn next(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// The ids of the publishes to queue `queue` forwarded to `node` that
    /// are still waiting for its confirm.
    pub(super) fn unsettled(&self, node: &str, vhost: &str, queue: &str) -> Vec<u64> {
        self.publishes
            .iter()
            .filter(|(_, f)| &*f.node == node && &*f.queue == queue && f.vhost == vhost)
            .map(|(id, _)| *id)
            .collect()
    }

    /// Whether forwarded publish `id` still waits for its master's confirm.
    pub(super) fn is_unsettled(&self, id: u64) -> bool {
        self.publishes.contains_key(&id)
    }

    /// The link stream of `node`'s current session (a new one, random, for
    /// a new session).
    fn stream(&mut self, node: &str) -> u64 {
        if let Some(s) = self.streams.get(node) {
            return *s;
        }
        let s = rand::RngCore::next_u64(&mut rand::rng());
        self.streams.insert(node.to_owned(), s);
        s
    }
}

impl Conn {
    /// Sends a message to a client (AMQP) or down a link (forwarded consumer or get).
    pub(crate) fn send_message(
        &mut self,
        ch: ChannelId,
        method: &ContentMethod<'_>,
        props: &BasicProperties,
        meta: &Bytes,
        body: &Bytes,
    ) {
        match &mut self.link {
            None => {
                if let ContentMethod::Deliver { redelivered, .. }
                | ContentMethod::GetOk { redelivered, .. } = method
                {
                    self.count_delivery(ch, *redelivered);
                }
                self.amqp.send_content(ch, method, props, body);
            }
            Some(l) => match method {
                ContentMethod::Deliver {
                    consumer_tag,
                    delivery_tag,
                    redelivered,
                    ..
                } => l.out.push(LinkMsg::Deliver {
                    cid: consumer_tag.parse().unwrap_or(0),
                    tag: *delivery_tag,
                    redelivered: *redelivered,
                    vhost: self.vhost.to_string(),
                    meta: meta.clone(),
                    body: body.clone(),
                }),
                ContentMethod::GetOk {
                    delivery_tag,
                    redelivered,
                    message_count,
                    ..
                } => {
                    let req = l.gets.pop_front().unwrap_or(0);
                    l.out.push(LinkMsg::GetReply {
                        req,
                        msg: Some((
                            *delivery_tag,
                            *redelivered,
                            meta.clone(),
                            body.clone(),
                            *message_count,
                        )),
                    });
                }
                ContentMethod::Return { .. } => {}
            },
        }
    }

    /// A forwarded get whose answer waited (for a mirrored queue's ring) is
    /// answered next: its request goes first in line.
    pub(crate) fn answering_get(&mut self, req: Option<u64>) {
        if let (Some(req), Some(l)) = (req, self.link.as_mut()) {
            l.gets.push_front(req);
        }
    }

    /// The request of the forwarded get being handled now, taken out of
    /// line while its answer waits (see [`Self::answering_get`]).
    pub(crate) fn defer_get(&mut self) -> Option<u64> {
        self.link.as_mut()?.gets.pop_back()
    }

    /// A reply of this client's is answered later: its next commands wait
    /// for it (see `Conn::replies_waiting`; a link's own order is kept by
    /// its requests).
    pub(crate) fn reply_waits(&mut self) {
        if self.link.is_none() {
            self.replies_waiting += 1;
        }
    }

    /// Answers a get with get-empty (to a client or down a link).
    pub(crate) fn send_get_empty(&mut self, ch: ChannelId) {
        match &mut self.link {
            None => {
                self.count(ch, |n| n.get_empty += 1);
                self.amqp.reply(ch, Reply::BasicGetEmpty);
            }
            Some(l) => {
                let req = l.gets.pop_front().unwrap_or(0);
                l.out.push(LinkMsg::GetReply { req, msg: None });
            }
        }
    }

    /// Tells a consumer its queue is gone (`basic.cancel`, or down a link).
    pub(crate) fn cancel_consumer(&mut self, ch: ChannelId, tag: &str) {
        match &mut self.link {
            None => {
                self.amqp.cancel_consumer(ch, tag);
            }
            Some(l) => l.out.push(LinkMsg::Cancelled {
                cid: tag.parse().unwrap_or(0),
            }),
        }
    }

    /// A publish from a link settled: tell the origin (false: not a link).
    pub(crate) fn link_confirmed(&mut self, id: u64, ack: bool) -> bool {
        let Some(l) = &mut self.link else {
            return false;
        };
        push_settled(&mut l.out, ack, id);
        (self.waker)();
        true
    }
}

impl Broker {
    /// Sets the waker of the shell task that carries link messages, also
    /// for the links whose input came first (a listener accepts as soon as
    /// it is up): their output, a confirm after a group commit, would
    /// otherwise wake nothing. Wakes it at once if output waits already.
    pub fn set_link_waker(&mut self, waker: Waker) {
        let mut waiting = !self.links.out.is_empty();
        for c in self.conns.values_mut() {
            if let Some(l) = &c.link {
                waiting |= !l.out.is_empty();
                c.waker = waker.clone();
            }
        }
        if waiting {
            waker();
        }
        self.links.waker = Some(waker);
    }

    /// Says which node serves queue `name` (its master), `None` for this
    /// node. A queue served elsewhere is forwarded there; this node's
    /// consumers of it follow the master when it moves.
    pub fn set_queue_master(&mut self, vhost: &str, name: &str, master: Option<&str>) {
        let Some(q) = self
            .vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(name))
        else {
            return;
        };
        let same = match (&q.remote, master) {
            (None, None) => true,
            (Some(at), Some(m)) => at.is(m),
            _ => false,
        };
        if same || (master.is_none() && q.handed_over) {
            return;
        }
        q.handed_over = false;
        q.held_for_replica = false;
        q.stale_master = None;
        q.master_down = None;
        let previous = q.remote.as_ref().and_then(Elsewhere::node).cloned();
        tracing::info!(%vhost, queue = %name, master = master.unwrap_or("this node"), "queue served by");
        q.remote = master.map(|m| Elsewhere::Node(Arc::from(m)));
        q.remote_figures = None;
        if master.is_none() {
            // A new master's x-expires counts from its takeover (as
            // RabbitMQ's promoted mirror), once other nodes' consumers had
            // time to find it.
            q.last_used_ms = self.now + super::TAKEOVER_GRACE_MS;
        }
        if let Some(previous) = previous {
            self.wait_for_old_master(vhost, name, previous);
        }
        // Publishes held for the next master go first: declares waiting
        // for its counts then count them.
        self.unpark(vhost, name);
        self.redirect_counts(vhost, name, master, false);
        self.redirect_gets(vhost, name, master);
        let Some(q) = self.queue_mut(vhost, name) else {
            return;
        };
        let qname = q.name.clone();
        // Consumers that asked for it are told of the failover (RabbitMQ's
        // x-cancel-on-ha-failover) instead of following the new master.
        let cancelled: Vec<Consumer> = q
            .consumers
            .iter()
            .filter(|c| c.cancel_on_failover)
            .cloned()
            .collect();
        q.consumers.retain(|c| !c.cancel_on_failover);
        for c in &cancelled {
            if c.remote_cid != 0 {
                self.links.consumers.remove(&c.remote_cid);
            }
            if let Some(conn) = self.conns.get_mut(&c.conn) {
                if let Some(ch) = conn.channels.get_mut(&c.channel) {
                    ch.consumers.remove(&c.tag);
                }
                conn.cancel_consumer(c.channel, &c.tag);
                conn.wake(0, c.conn);
            }
        }
        let Some(q) = self
            .vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(name))
        else {
            return;
        };
        let consumers: Vec<(u64, Consumer)> = q
            .consumers
            .iter()
            .filter(|c| c.remote_cid != 0)
            .map(|c| (c.remote_cid, c.clone()))
            .collect();
        if let Some(m) = master {
            // Other nodes' consumers came here over their links because this
            // node was the master; their nodes now forward them to the new
            // master themselves. Passed on from here, the new master's
            // deliveries would come back through this node to a consumer
            // its own node no longer knows, and sit unacknowledged for ever.
            let (theirs, ours): (Vec<Consumer>, Vec<Consumer>) = std::mem::take(&mut q.consumers)
                .into_iter()
                .partition(|c| self.conns.get(&c.conn).is_some_and(|x| x.link.is_some()));
            q.consumers = ours;
            for c in theirs {
                if let Some(ch) = self
                    .conns
                    .get_mut(&c.conn)
                    .and_then(|x| x.channels.get_mut(&c.channel))
                {
                    ch.consumers.remove(&c.tag);
                }
            }
            // An id below the new master's reset threshold was given to it
            // in an earlier session (or was never given to it): a delivery
            // for such an id would be taken for one of that session's, which
            // the master requeues itself, and dropped here once the consumer
            // is gone, leaving the master holding it unacknowledged for
            // ever (chaos seed 57 with four queues). Such a consumer follows
            // the queue under a new id.
            let below = self.links.retired_below.get(m).copied().unwrap_or(0);
            for c in q.consumers.iter_mut() {
                if c.remote_cid == 0 || c.remote_cid < below {
                    if c.remote_cid != 0 {
                        self.links.consumers.remove(&c.remote_cid);
                    }
                    c.remote_cid = self.links.next();
                }
                // Deliveries still out from an earlier master are not counted.
                c.unacked = 0;
                c.reserved = 0;
                self.links.consumers.insert(
                    c.remote_cid,
                    RemoteConsumer {
                        conn: c.conn,
                        channel: c.channel,
                        tag: c.tag.clone(),
                        vhost: vhost.to_owned(),
                        queue: qname.clone(),
                        no_ack: c.no_ack,
                    },
                );
                let msg = LinkMsg::Consume {
                    vhost: vhost.to_owned(),
                    queue: qname.to_string(),
                    cid: c.remote_cid,
                    prefetch: forward_prefetch(&self.conns, c),
                    no_ack: c.no_ack,
                    priority: c.priority,
                    exclusive: c.exclusive,
                };
                self.links.send(m, msg);
            }
            // After the consumers still here: the master counts the one that
            // left only if none is left.
            if std::mem::take(&mut q.consumer_left_unseen) && q.opts.auto_delete {
                let msg = LinkMsg::ConsumerLeft {
                    vhost: vhost.to_owned(),
                    queue: qname.to_string(),
                };
                self.links.send(m, msg);
            }
        } else {
            for (cid, _) in &consumers {
                self.links.consumers.remove(cid);
            }
            for c in q.consumers.iter_mut() {
                c.remote_cid = 0;
                c.unacked = 0;
            }
            // This node has them now.
            for (cid, _) in consumers {
                self.answer_consume_ok(cid);
            }
            if !self.count_consumer_left(vhost, name) {
                self.after_queue_op(vhost, name);
            }
        }
    }

    /// Counts, on the node that serves queue `name`, a consumer that left
    /// while the queue had no master ([`Queue::consumer_left_unseen`]): an
    /// `auto-delete` queue with no consumer left goes, as if the consumer
    /// had left here. Returns whether the queue was deleted.
    pub(super) fn count_consumer_left(&mut self, vhost: &str, name: &str) -> bool {
        let Some(q) = self.queue_mut(vhost, name) else {
            return false;
        };
        if q.remote.is_some() || !q.consumer_left_unseen {
            return false;
        }
        q.consumer_left_unseen = false;
        q.had_consumers = true;
        let deleted = self.auto_delete_if_unused(vhost, name);
        if deleted {
            tracing::info!(%vhost, queue = %name, "auto-delete queue deleted: its last consumer left while it had no master");
        }
        deleted
    }

    /// Forwards a publish to `node` (one sent again under its first
    /// identity, `Sent::Again`); returns whether a confirm is owed.
    pub(super) fn link_publish(
        &mut self,
        to: &Elsewhere,
        vhost: &str,
        queue: &Arc<str>,
        msg: &Msg,
        confirm: Option<(ConnId, ChannelId, u64)>,
    ) -> bool {
        let Elsewhere::Node(node) = to else {
            // No node serves the queue right now: refuse, the publisher resends.
            if let Some(c) = confirm {
                self.deferred_nacks.push(c);
            }
            return confirm.is_some();
        };
        let id = self.links.next();
        let identity = match msg.sent {
            Some(s) => s.id(),
            None => PublishId {
                publisher: self.links.stream(node),
                seq: id,
            },
        };
        let since_ms = match msg.sent {
            Some(Sent::Again { since_ms, .. }) => since_ms,
            _ => self.now,
        };
        let f = Forwarded {
            node: node.clone(),
            owed: confirm,
            identity,
            vhost: vhost.to_owned(),
            queue: queue.clone(),
            msg: Msg {
                sent: None,
                ..msg.clone()
            },
            since_ms,
        };
        self.links.publishes.insert(id, f);
        let m = LinkMsg::Publish {
            vhost: vhost.to_owned(),
            queue: queue.to_string(),
            id,
            publisher: identity.publisher,
            first: (identity.seq != id).then_some(identity.seq),
            meta: msg.meta.clone(),
            body: msg.body.clone(),
            persistent: msg.persistent,
            expiration_ms: msg.expiration_ms,
            priority: msg.priority,
        };
        self.links.send(node, m);
        self.links
            .in_flight
            .entry(node.to_string())
            .or_default()
            .push_back(id);
        confirm.is_some()
    }

    /// A new consumer of a forwarded queue: asks the master for deliveries.
    /// Unless `nowait`, the client's `consume-ok` is sent when the master
    /// has the consumer ([`LinkMsg::ConsumeOk`]); returns whether it waits
    /// (no master is known right now: it does not).
    pub(super) fn link_consume(
        &mut self,
        vhost: &str,
        queue: &Arc<str>,
        c: &mut Consumer,
        nowait: bool,
    ) -> bool {
        let Some(to) = self
            .vhosts
            .get(vhost)
            .and_then(|v| v.queues.get(queue))
            .and_then(|q| q.remote.clone())
        else {
            return false;
        };
        c.remote_cid = self.links.next();
        self.links.consumers.insert(
            c.remote_cid,
            RemoteConsumer {
                conn: c.conn,
                channel: c.channel,
                tag: c.tag.clone(),
                vhost: vhost.to_owned(),
                queue: queue.clone(),
                no_ack: c.no_ack,
            },
        );
        let msg = LinkMsg::Consume {
            vhost: vhost.to_owned(),
            queue: queue.to_string(),
            cid: c.remote_cid,
            prefetch: forward_prefetch(&self.conns, c),
            no_ack: c.no_ack,
            priority: c.priority,
            exclusive: c.exclusive,
        };
        let waits = !nowait && matches!(to, Elsewhere::Node(_));
        if waits {
            self.links.consume_oks.insert(
                c.remote_cid,
                PendingConsumeOk {
                    conn: c.conn,
                    channel: c.channel,
                    tag: c.tag.clone(),
                    since_ms: self.now,
                },
            );
            if let Some(conn) = self.conns.get_mut(&c.conn) {
                conn.reply_waits();
            }
        }
        self.links.send_to(&to, msg);
        waits
    }

    /// Sends the `consume-ok` of consumer `cid` if it still waits.
    fn answer_consume_ok(&mut self, cid: u64) {
        let Some(p) = self.links.consume_oks.remove(&cid) else {
            return;
        };
        let reply = Reply::BasicConsumeOk {
            consumer_tag: p.tag.to_string(),
        };
        self.answer_waiting(p.conn, p.channel, reply);
    }

    /// Sends `reply`, which client `conn` waits for, on channel `ch` if it
    /// is still open; the client's next commands go on.
    fn answer_waiting(&mut self, conn: ConnId, ch: ChannelId, reply: Reply) {
        if let Some(c) = self.conns.get_mut(&conn)
            && c.channels.contains_key(&ch)
        {
            c.amqp.reply(ch, reply);
        }
        self.reply_answered(conn);
    }

    /// The master refused consumer `cid`: it goes, and its client's channel
    /// is closed with 403 if the client still waits for its consume-ok (a
    /// consumer asked for again, after a link reset or a failover, is
    /// cancelled instead, as when its queue goes).
    fn consume_refused(&mut self, cid: u64, text: String) {
        let waiting = self.links.consume_oks.remove(&cid);
        let Some(rc) = self.links.consumers.remove(&cid) else {
            if let Some(p) = waiting {
                self.reply_answered(p.conn);
            }
            return;
        };
        if let Some(q) = self
            .vhosts
            .get_mut(&rc.vhost)
            .and_then(|v| v.queues.get_mut(&rc.queue))
        {
            q.consumers.retain(|x| x.remote_cid != cid);
        }
        let Some(c) = self.conns.get_mut(&rc.conn) else {
            return;
        };
        if let Some(ch) = c.channels.get_mut(&rc.channel) {
            ch.consumers.remove(&rc.tag);
        }
        match waiting {
            Some(p) => {
                let e = err(ReplyCode::AccessRefused, text).with_method(60, 20);
                c.amqp.channel_error(p.channel, e);
                self.reply_answered(p.conn);
            }
            None => c.cancel_consumer(rc.channel, &rc.tag),
        }
    }

    /// Answers the consumes that waited longer than [`COUNT_WAIT_MS`] for
    /// their master (it stays unreachable; the consumer is asked for again
    /// on the next link session).
    pub(crate) fn expire_consume_oks(&mut self, now_ms: u64) {
        let late: Vec<u64> = self
            .links
            .consume_oks
            .iter()
            .filter(|(_, p)| now_ms.saturating_sub(p.since_ms) >= COUNT_WAIT_MS)
            .map(|(cid, _)| *cid)
            .collect();
        for cid in late {
            self.answer_consume_ok(cid);
        }
    }

    /// Holds the `cancel-ok` of consumer `tag` of channel `ch`, whose
    /// cancel went to the master on `node` as consumer `cid`, until the
    /// master's [`LinkMsg::CancelOk`]; the deliveries it sent before still
    /// reach the client.
    pub(super) fn hold_cancel_ok(
        &mut self,
        (conn, channel): (ConnId, ChannelId),
        tag: &str,
        (node, cid): (Arc<str>, u64),
    ) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.reply_waits();
        }
        let p = PendingCancelOk {
            node,
            conn,
            channel,
            tag: Arc::from(tag),
            since_ms: self.now,
        };
        self.links.cancel_oks.insert(cid, p);
    }

    /// Sends the `cancel-ok` of consumer `cid` if it still waits.
    fn answer_cancel_ok(&mut self, cid: u64) {
        let Some(p) = self.links.cancel_oks.remove(&cid) else {
            return;
        };
        self.links.consumers.remove(&cid);
        let reply = Reply::BasicCancelOk {
            consumer_tag: p.tag.to_string(),
        };
        self.answer_waiting(p.conn, p.channel, reply);
    }

    /// Answers the cancels that waited [`COUNT_WAIT_MS`] for their master,
    /// or (`node`) whose master's link is down.
    pub(crate) fn expire_cancel_oks(&mut self, now_ms: u64, node: Option<&str>) {
        let late: Vec<u64> = self
            .links
            .cancel_oks
            .iter()
            .filter(|(_, p)| {
                now_ms.saturating_sub(p.since_ms) >= COUNT_WAIT_MS || node == Some(&*p.node)
            })
            .map(|(cid, _)| *cid)
            .collect();
        for cid in late {
            self.answer_cancel_ok(cid);
        }
    }

    /// The master's node and the id of consumer `tag` of channel `ch`, if
    /// it is forwarded to a master on another node.
    pub(super) fn forwarded_consumer(
        &self,
        id: ConnId,
        ch: ChannelId,
        tag: &str,
    ) -> Option<(Arc<str>, u64)> {
        let c = self.conns.get(&id)?;
        let qname = c.channels.get(&ch)?.consumers.get(tag)?;
        let q = self.vhosts.get(&c.vhost)?.queues.get(qname)?;
        let node = q.remote.as_ref()?.node()?.clone();
        let x = q
            .consumers
            .iter()
            .find(|x| x.conn == id && x.channel == ch && &*x.tag == tag)?;
        self.links
            .consumers
            .contains_key(&x.remote_cid)
            .then_some((node, x.remote_cid))
    }

    /// A consumer of a forwarded queue is gone.
    /// While its cancel-ok waits for the master ([`Self::hold_cancel_ok`])
    /// the origin keeps its record: the master's last deliveries to it
    /// still reach the client.
    pub(super) fn link_cancel(&mut self, to: &Elsewhere, vhost: &str, cid: u64) {
        let known = if self.links.cancel_oks.contains_key(&cid) {
            self.links.consumers.contains_key(&cid)
        } else {
            self.links.consumers.remove(&cid).is_some()
        };
        if known {
            let msg = LinkMsg::Cancel {
                vhost: vhost.to_owned(),
                cid,
            };
            self.links.send_to(to, msg);
        }
    }

    /// Settles forwarded deliveries, each (master, tag) of `settles`: one
    /// message per master, so they are settled there together.
    pub(super) fn link_settle_all(
        &mut self,
        vhost: &str,
        settles: Vec<(Elsewhere, u64)>,
        how: Settle,
    ) {
        let mut by_node: Vec<(Elsewhere, Vec<u64>)> = Vec::new();
        for (at, tag) in settles {
            match by_node.iter_mut().find(|(n, _)| *n == at) {
                Some((_, tags)) => tags.push(tag),
                None => by_node.push((at, vec![tag])),
            }
        }
        for (at, tags) in by_node {
            self.link_settle(&at, vhost, tags, how);
        }
    }

    /// Settles forwarded deliveries `tags` at their master, together.
    pub(super) fn link_settle(&mut self, to: &Elsewhere, vhost: &str, tags: Vec<u64>, how: Settle) {
        let Elsewhere::Node(node) = to else {
            tracing::debug!(%vhost, settled = tags.len(), "settlements of a lost link's deliveries dropped: the queue's next master delivers them again");
            return;
        };
        let how = match how {
            Settle::Ack => 0,
            Settle::Requeue => 1,
            Settle::Discard => 2,
        };
        self.links.send(
            node,
            LinkMsg::Settle {
                vhost: vhost.to_owned(),
                tags,
                how,
            },
        );
    }

    /// Answers a client's command `what` on a queue served by `node` once
    /// the master's counts come: a `queue.declare` with them, a
    /// `queue.purge` (the master purges) with the count removed, a
    /// conditional `queue.delete` after checking them.
    pub(super) fn link_count(
        &mut self,
        node: &Arc<str>,
        (conn, channel): (ConnId, ChannelId),
        vhost: &str,
        queue: &str,
        what: Asked,
    ) {
        let req = self.links.next();
        if let Some(c) = self.conns.get_mut(&conn) {
            c.reply_waits();
        }
        let p = PendingCount {
            what,
            node: node.clone(),
            conn,
            channel,
            vhost: vhost.to_owned(),
            queue: queue.to_owned(),
            since_ms: self.now,
        };
        let msg = p.ask(req);
        self.links.counts.insert(req, p);
        self.links.send(node, msg);
    }

    /// Holds a client's `queue.declare` of a queue with no master right now
    /// (or with publishes held for the next one, `parked`) until the next
    /// master is named (`redirect_counts` asks it, after the held
    /// publishes) or this node serves it (`redirect_counts`); after
    /// [`COUNT_WAIT_MS`] this node's counts answer it.
    pub(super) fn hold_count(
        &mut self,
        (conn, channel): (ConnId, ChannelId),
        vhost: &str,
        queue: &str,
    ) {
        let req = self.links.next();
        if let Some(c) = self.conns.get_mut(&conn) {
            c.reply_waits();
        }
        // The tick looks at it until a master takes it (`unpark_all`).
        self.parked_queues
            .insert((vhost.to_owned(), Arc::from(queue)));
        let p = PendingCount {
            what: Asked::Declare,
            node: Arc::from(NO_MASTER),
            conn,
            channel,
            vhost: vhost.to_owned(),
            queue: queue.to_owned(),
            since_ms: self.now,
        };
        self.links.counts.insert(req, p);
    }

    /// Answers request `req` of node `to` with queue `queue`'s counts (the
    /// ready messages, or `purged` for a purge).
    fn send_counted(&mut self, to: &str, vhost: &str, queue: &str, req: u64, purged: Option<u64>) {
        let (ready, consumers) = self.queue_counts(vhost, queue);
        let messages = purged.unwrap_or(ready);
        self.links.send(
            to,
            LinkMsg::Counted {
                req,
                messages,
                consumers,
            },
        );
    }

    /// Purges queue `name` here (this node serves it): how many ready
    /// messages went, or `None` if it is not here or its store refused.
    pub(super) fn purge_here(&mut self, vhost: &str, name: &str) -> Option<u64> {
        let q = self.vhosts.get_mut(vhost)?.queues.get_mut(name)?;
        let n = q.store.purge().ok()?;
        self.mirror_turn(vhost, name);
        Some(n)
    }

    /// Queue `queue`'s ready messages and consumers as this node knows them.
    fn queue_counts(&self, vhost: &str, queue: &str) -> (u64, u32) {
        self.vhosts
            .get(vhost)
            .and_then(|v| v.queues.get(queue))
            .map_or((0, 0), |q| {
                let f = q.figures();
                (f.ready, u32::try_from(f.consumers).unwrap_or(u32::MAX))
            })
    }

    /// Declares of queue `name` waiting for counts follow its master to
    /// `master` (asked there again), or are answered here if it is this node;
    /// with `only_held`, only those held while it had no master.
    pub(super) fn redirect_counts(
        &mut self,
        vhost: &str,
        name: &str,
        master: Option<&str>,
        only_held: bool,
    ) {
        let waiting: Vec<u64> = self
            .links
            .counts
            .iter()
            .filter(|(_, p)| p.vhost == vhost && p.queue == name)
            .filter(|(_, p)| !only_held || &*p.node == NO_MASTER)
            .map(|(req, _)| *req)
            .collect();
        for req in waiting {
            // A purge the old master may have made (and passed to its
            // mirrors) is not made again: it would take what came since.
            if self
                .links
                .counts
                .get(&req)
                .is_some_and(|p| p.what == Asked::Purge)
            {
                if let Some(p) = self.links.counts.remove(&req) {
                    self.fail_count(p);
                }
                continue;
            }
            match master {
                Some(m) => {
                    if let Some(p) = self.links.counts.get_mut(&req) {
                        p.node = Arc::from(m);
                        let msg = p.ask(req);
                        self.links.send(m, msg);
                    }
                }
                None => {
                    if let Some(p) = self.links.counts.remove(&req) {
                        let (ready, consumers) = self.queue_counts(vhost, name);
                        self.answer_count(p, ready, consumers);
                    }
                }
            }
        }
    }

    /// Closes the channel of a purge or conditional delete whose outcome
    /// at the master is not known (unreachable, or the queue failed over),
    /// as RabbitMQ answers one for a queue whose node is unreachable.
    fn fail_count(&mut self, p: PendingCount) {
        let text = format!(
            "home node '{}' of durable queue '{}' in vhost '{}' is down or inaccessible",
            p.node, p.queue, p.vhost
        );
        let method = if p.what == Asked::Purge { 30 } else { 40 };
        if let Some(c) = self.conns.get_mut(&p.conn) {
            let e = err(ReplyCode::NotFound, text).with_method(50, method);
            c.amqp.channel_error(p.channel, e);
        }
        self.reply_answered(p.conn);
    }

    /// Answers, with this node's counts, the declares that waited longer
    /// than [`COUNT_WAIT_MS`] for their master's (it stays unreachable).
    pub(crate) fn expire_counts(&mut self, now_ms: u64) {
        let late: Vec<PendingCount> = self
            .links
            .counts
            .extract_if(|_, p| now_ms.saturating_sub(p.since_ms) >= COUNT_WAIT_MS)
            .map(|(_, p)| p)
            .collect();
        for p in late {
            if p.what != Asked::Declare {
                self.fail_count(p);
                continue;
            }
            let (messages, consumers) = self.queue_counts(&p.vhost, &p.queue);
            self.answer_count(p, messages, consumers);
        }
    }

    /// Asks, once a [`PEEK_EVERY_MS`], the master of every queue this node
    /// forwards for its figures: what this node's API shows of the queue.
    pub(crate) fn peek_masters(&mut self, now_ms: u64) {
        if now_ms.saturating_sub(self.links.peeked_at_ms) < PEEK_EVERY_MS {
            return;
        }
        self.links.peeked_at_ms = now_ms;
        let mut asks: HashMap<Arc<str>, Vec<(String, String)>> = HashMap::new();
        for (vn, v) in &self.vhosts {
            for q in v.queues.values() {
                if let Some(Elsewhere::Node(m)) = &q.remote {
                    asks.entry(m.clone())
                        .or_default()
                        .push((vn.clone(), q.name.to_string()));
                }
            }
        }
        for (node, queues) in asks {
            self.links.send(&node, LinkMsg::Peek { queues });
        }
    }

    /// Sends the reply a [`PendingCount`] waited for: declare-ok or
    /// purge-ok, or a conditional delete's outcome.
    fn answer_count(&mut self, p: PendingCount, messages: u64, consumers: u32) {
        let open = self
            .conns
            .get(&p.conn)
            .is_some_and(|c| c.channels.contains_key(&p.channel));
        let message_count = u32::try_from(messages).unwrap_or(u32::MAX);
        let reply = match p.what {
            Asked::Purge => Reply::QueuePurgeOk { message_count },
            Asked::Declare => Reply::QueueDeclareOk {
                queue: p.queue,
                message_count,
                consumer_count: consumers,
            },
            Asked::Delete {
                if_unused,
                if_empty,
            } if open => {
                // Its metadata change is this connection's to wait for,
                // as when the delete is made at once.
                let mark = self.begin_recording(p.conn);
                let figures = (messages, u64::from(consumers));
                let cond = (if_unused, if_empty);
                let done = self.delete_if(
                    (p.conn, p.channel),
                    &p.vhost,
                    &p.queue,
                    cond,
                    figures,
                    false,
                );
                if let Err(e) = done
                    && let Some(c) = self.conns.get_mut(&p.conn)
                {
                    c.amqp.channel_error(p.channel, e.with_method(50, 40));
                }
                if let Some(mark) = mark {
                    self.end_recording(p.conn, mark, (50, 40));
                }
                self.reply_answered(p.conn);
                return;
            }
            Asked::Delete { .. } => {
                self.reply_answered(p.conn);
                return;
            }
        };
        if open && let Some(c) = self.conns.get_mut(&p.conn) {
            c.amqp.reply(p.channel, reply);
        }
        self.reply_answered(p.conn);
    }

    /// Forwards a `basic.get`.
    pub(super) fn link_get(
        &mut self,
        to: &Elsewhere,
        (conn, ch): (ConnId, ChannelId),
        vhost: &str,
        queue: &Arc<str>,
        no_ack: bool,
    ) {
        // No master right now: held for the next one (`redirect_gets`).
        let node = to.node().cloned().unwrap_or_else(|| Arc::from(NO_MASTER));
        let req = self.links.next();
        // A link's get waits out of line (its request is answered when the
        // master's answer comes).
        let asked = self.conns.get_mut(&conn).and_then(|c| {
            c.reply_waits();
            c.defer_get()
        });
        self.links.gets.insert(
            req,
            RemoteGet {
                node: node.clone(),
                conn,
                channel: ch,
                no_ack,
                vhost: vhost.to_owned(),
                queue: queue.clone(),
                req: asked,
                since_ms: self.now,
            },
        );
        if &*node == NO_MASTER {
            // The tick looks at it until a master takes it (`unpark_all`).
            self.parked_queues.insert((vhost.to_owned(), queue.clone()));
            return;
        }
        let msg = LinkMsg::Get {
            vhost: vhost.to_owned(),
            queue: queue.to_string(),
            req,
            no_ack,
        };
        self.links.send(&node, msg);
    }

    /// Work for queue `queue` came from node `from`: if this node takes
    /// `from` for the master, `from` has seen the master move and this node
    /// not yet, so the work waits here for the move instead of going back
    /// ([`Queue::stale_master`](super::state::Queue)).
    fn note_stale_master(&mut self, from: &str, vhost: &str, queue: &str) {
        let until = self.now + STALE_MASTER_MS;
        if let Some(q) = self.queue_mut(vhost, queue)
            && q.remote.as_ref().is_some_and(|at| at.is(from))
            && q.stale_master.is_none()
        {
            tracing::debug!(%vhost, %queue, node = %from, "work from the node taken for the master: held until the move is known");
            q.stale_master = Some((Arc::from(from), until));
        }
    }

    /// Sends the gets of queue `name` held while it had no master
    /// ([`Self::link_get`]) to its next master `master`, in order, or
    /// makes them here if this node serves it now (`None`).
    pub(super) fn redirect_gets(&mut self, vhost: &str, name: &str, master: Option<&str>) {
        let mut held: Vec<(u64, RemoteGet)> = self
            .links
            .gets
            .extract_if(|_, g| &*g.node == NO_MASTER && g.vhost == vhost && &*g.queue == name)
            .collect();
        held.sort_by_key(|(req, _)| *req);
        for (req, mut g) in held {
            match master {
                Some(m) => {
                    g.node = Arc::from(m);
                    let msg = LinkMsg::Get {
                        vhost: vhost.to_owned(),
                        queue: name.to_owned(),
                        req,
                        no_ack: g.no_ack,
                    };
                    self.links.gets.insert(req, g);
                    self.links.send(m, msg);
                }
                None => self.get_held_here(g),
            }
        }
    }

    /// Makes here a get held while its queue had no master.
    fn get_held_here(&mut self, g: RemoteGet) {
        let waiter = g.conn;
        if let Some(c) = self.conns.get_mut(&g.conn) {
            // A link's request goes back in line, where `get` takes it.
            if let (Some(r), Some(l)) = (g.req, c.link.as_mut()) {
                l.gets.push_back(r);
            }
            let get = basic::Get {
                queue: g.queue.as_ref().into(),
                no_ack: g.no_ack,
            };
            if c.channels.contains_key(&g.channel)
                && self.get(g.conn, g.channel, &get).is_err()
                && let Some(c) = self.conns.get_mut(&g.conn)
            {
                c.send_get_empty(g.channel);
            }
        }
        self.reply_answered(waiter);
    }

    /// Answers empty the gets held for a queue's next master longer than
    /// [`COUNT_WAIT_MS`].
    pub(crate) fn expire_held_gets(&mut self, now_ms: u64) {
        let late: Vec<RemoteGet> = self
            .links
            .gets
            .extract_if(|_, g| {
                &*g.node == NO_MASTER && now_ms.saturating_sub(g.since_ms) >= COUNT_WAIT_MS
            })
            .map(|(_, g)| g)
            .collect();
        for g in late {
            let waiter = g.conn;
            self.get_reply(g, None);
            self.reply_answered(waiter);
        }
    }

    /// Whether more messages for `node` wait to be sent than flow control
    /// allows ([`LINK_BEHIND_MAX`]): the node does not read its link as fast
    /// as this node writes to it (its queues hold forwarded publishes back,
    /// or the network is slow).
    pub(crate) fn link_behind(&self, node: &str) -> bool {
        let queued = self.links.out.get(node).map_or(0, Vec::len);
        let unsent = self.links.unsent.get(node).copied().unwrap_or(0);
        queued + unsent > LINK_BEHIND_MAX
    }

    /// Whether more publishes forwarded to `node` than flow control allows
    /// are not yet taken in there ([`LINK_PUBLISHES_MAX`]).
    pub(crate) fn link_publishes_behind(&self, node: &str) -> bool {
        self.links
            .in_flight
            .get(node)
            .is_some_and(|f| f.len() > LINK_PUBLISHES_MAX)
    }

    /// The shell wrote `n` messages of what [`Self::take_link_out`] gave it
    /// for `node`, or gave them up (the link broke): they no longer count
    /// toward [`Self::link_behind`].
    pub fn link_sent(&mut self, node: &str, n: usize) {
        if let Some(u) = self.links.unsent.get_mut(node) {
            *u = u.saturating_sub(n);
        }
    }

    /// Tells each of `nodes` this node's resource alarms.
    pub fn announce_alarms(&mut self, nodes: &[String]) {
        let a = self.local_alarms();
        for n in nodes {
            self.links.send(
                n,
                LinkMsg::Alarms {
                    memory: a.memory,
                    disk: a.disk,
                },
            );
        }
    }

    /// Link messages waiting for each node (the shell sends each batch in order).
    pub fn take_link_out(&mut self) -> Vec<(String, Vec<LinkMsg>)> {
        let mut out: Vec<(String, Vec<LinkMsg>)> = self.links.out.drain().collect();
        let mut resume = Vec::new();
        for (id, c) in &mut self.conns {
            if let Some(l) = &mut c.link
                && !l.out.is_empty()
            {
                let msgs = std::mem::take(&mut l.out);
                match out.iter_mut().find(|(n, _)| *n == l.node) {
                    Some((_, v)) => v.extend(msgs),
                    None => out.push((l.node.clone(), msgs)),
                }
                // Its deliveries are on their way: they no longer count
                // against its output limit (as a client's once written).
                c.out_pending = 0;
                if std::mem::take(&mut c.throttled) {
                    resume.push(*id);
                }
            }
        }
        if !resume.is_empty() {
            for id in resume {
                self.resume_deliveries(id);
            }
            // What they hand out goes with the next batch.
            self.wake_clients();
        }
        for (node, msgs) in &out {
            *self.links.unsent.entry(node.clone()).or_default() += msgs.len();
        }
        out
    }

    /// The link state shared with `node` was dropped on its side (a new link
    /// connection, from it or to it): asks it again for deliveries to this
    /// node's consumers of the queues it masters. Asking twice is harmless.
    pub fn resubscribe(&mut self, node: &str) {
        // Its link is back: work held for its queues goes there.
        let mut back = Vec::new();
        for (vhost, v) in &mut self.vhosts {
            for (name, q) in &mut v.queues {
                if q.master_down.as_ref().is_some_and(|(n, _)| &**n == node) {
                    q.master_down = None;
                    back.push((vhost.clone(), name.clone()));
                }
            }
        }
        for (vhost, name) in back {
            self.unpark(&vhost, &name);
        }
        let mut msgs = Vec::new();
        for (cid, rc) in &self.links.consumers {
            let Some(q) = self
                .vhosts
                .get(&rc.vhost)
                .and_then(|v| v.queues.get(&rc.queue))
            else {
                continue;
            };
            if !q.remote.as_ref().is_some_and(|at| at.is(node)) {
                continue;
            }
            let Some(c) = q.consumers.iter().find(|c| c.remote_cid == *cid) else {
                continue;
            };
            msgs.push(LinkMsg::Consume {
                vhost: rc.vhost.clone(),
                queue: rc.queue.to_string(),
                cid: *cid,
                prefetch: forward_prefetch(&self.conns, c),
                no_ack: c.no_ack,
                priority: c.priority,
                exclusive: c.exclusive,
            });
        }
        if !msgs.is_empty() {
            tracing::info!(%node, consumers = msgs.len(), "asking the node again for deliveries to this node's consumers");
        }
        // A purge is not asked again: the lost session may have made it,
        // and a second would take what came since. It fails after
        // COUNT_WAIT_MS (`expire_counts`).
        for (req, p) in &self.links.counts {
            if &*p.node == node && p.what != Asked::Purge {
                msgs.push(p.ask(*req));
            }
        }
        for m in msgs {
            self.links.send(node, m);
        }
    }

    /// Handles link messages from node `from` (what they delete, an
    /// auto-delete queue whose last consumer went, is committed off the
    /// lock: `commits.rs`).
    pub fn link_input(&mut self, from: &str, msgs: Vec<LinkMsg>, now_ms: u64) {
        self.detached(|b| b.link_messages(from, msgs, now_ms));
    }

    fn link_messages(&mut self, from: &str, msgs: Vec<LinkMsg>, now_ms: u64) {
        self.now = now_ms;
        self.current = 0;
        // The queues of consumers cancelled in this batch are driven after
        // it: a closed channel's cancels come with its requeues, which go
        // back first (to a single-active-consumer queue's next consumer).
        let mut cancelled = Vec::new();
        let mut taken = None;
        for m in msgs {
            if let LinkMsg::Publish { id, .. } = &m {
                taken = Some(*id);
            }
            self.link_one(from, m, &mut cancelled);
        }
        if let Some(upto) = taken {
            self.links.send(from, LinkMsg::Taken { upto });
        }
        self.end_old_master_waits();
        for (vhost, queue) in cancelled {
            self.after_queue_op(&vhost, &queue);
        }
        self.wake_clients();
    }

    /// Wakes every connection task with output, and the link shell if a
    /// link has some.
    pub(crate) fn wake_clients(&mut self) {
        let waker = self.links.waker.clone();
        let mut link_output = !self.links.out.is_empty();
        for (id, c) in &mut self.conns {
            if let Some(l) = &c.link {
                link_output |= !l.out.is_empty();
                continue;
            }
            if !c.confirm_dirty.is_empty() || c.amqp.has_output() {
                c.wake(0, *id);
            }
        }
        if link_output && let Some(w) = waker {
            w();
        }
    }

    fn link_conn(&mut self, from: &str, vhost: &str) -> Option<ConnId> {
        if !self.vhosts.contains_key(vhost) {
            return None;
        }
        if let Some(id) = self.links.conns.get(&(from.to_owned(), vhost.to_owned())) {
            return Some(*id);
        }
        let id = self.next_conn;
        self.next_conn += 1;
        let waker = self.links.waker.clone().unwrap_or_else(|| Arc::new(|| {}));
        let mut channels = IdMap::default();
        channels.insert(LINK_CHANNEL, Channel::default());
        let all = Permission::new(&PermissionDef {
            user: from.to_owned(),
            vhost: vhost.to_owned(),
            configure: ".*".into(),
            write: ".*".into(),
            read: ".*".into(),
        });
        self.conns.insert(
            id,
            Conn {
                amqp: Connection::new(self.cfg.amqp.clone()),
                peer: SocketAddr::from(([0, 0, 0, 0], 0)),
                tls: None,
                user: format!("node {from}"),
                vhost: vhost.to_owned(),
                perm: Some(all),
                channels,
                waker,
                woken: false,
                out_pending: 0,
                throttled: false,
                confirm_dirty: Vec::new(),
                closed: false,
                client_closed: false,
                publisher: false,
                placed: true,
                moving: None,
                resume: None,
                targets: Vec::new(),
                committing: None,
                replies_waiting: 0,
                counters: super::stats::MessageCounters::default(),
                latency: super::stats::LatencyHistogram::default(),
                octets: super::stats::Octets::default(),
                link: Some(Link {
                    node: from.to_owned(),
                    out: Vec::new(),
                    gets: VecDeque::new(),
                }),
            },
        );
        self.links
            .conns
            .insert((from.to_owned(), vhost.to_owned()), id);
        Some(id)
    }

    /// Handles one message from node `from`; a cancelled consumer's queue
    /// goes to `cancelled`, to be driven after the batch.
    fn link_one(&mut self, from: &str, m: LinkMsg, cancelled: &mut Vec<(String, Arc<str>)>) {
        match m {
            LinkMsg::Hello { .. } | LinkMsg::Welcome { .. } => {}
            LinkMsg::Publish {
                vhost,
                queue,
                id,
                publisher,
                first,
                meta,
                body,
                persistent,
                expiration_ms,
                priority,
            } => {
                let Some(pc) = self.link_conn(from, &vhost) else {
                    self.links.settle(from, false, id);
                    return;
                };
                let target: Vec<Arc<str>> = self
                    .vhosts
                    .get(&vhost)
                    .and_then(|v| v.queues.get_key_value(queue.as_str()))
                    .map(|(k, _)| k.clone())
                    .into_iter()
                    .collect();
                if target.is_empty() {
                    // Not (or no longer, or not yet) a queue here: the
                    // publisher hears it may be lost and resends, rather
                    // than a confirm for a message nobody holds.
                    self.links.settle(from, false, id);
                    return;
                }
                let msg = Msg {
                    meta,
                    body,
                    persistent,
                    expiration_ms,
                    priority,
                    sent: Some(Sent::ByLink {
                        id: PublishId {
                            publisher,
                            seq: first.unwrap_or(id),
                        },
                        again: first.is_some(),
                    }),
                };
                self.note_stale_master(from, &vhost, &queue);
                let owed = Some((pc, LINK_CHANNEL, id));
                // Counted before the enqueue, so that a confirm it makes
                // at once (a publish its replica held already, sent again)
                // counts too.
                if let Some(p) = link_pending(&mut self.conns, pc) {
                    p.insert(id, PROVISIONAL);
                }
                let enqueued = self.enqueue(&vhost, &target, &msg, owed);
                let left = link_pending(&mut self.conns, pc).and_then(|p| p.remove(&id));
                let Ok(pending) = enqueued else {
                    self.links.settle(from, false, id);
                    self.deferred_nacks.clear();
                    return;
                };
                // Gone: nacked meanwhile (and said so).
                if let Some(left) = left {
                    let pending = pending.saturating_sub(PROVISIONAL - left);
                    if pending == 0 {
                        self.links.settle(from, true, id);
                    } else if let Some(p) = link_pending(&mut self.conns, pc) {
                        p.insert(id, pending);
                    }
                }
                for (conn, ch, cseq) in std::mem::take(&mut self.deferred_nacks) {
                    nack_one(&mut self.conns, conn, ch, cseq);
                }
            }
            LinkMsg::Consume {
                vhost,
                queue,
                cid,
                prefetch,
                no_ack,
                priority,
                exclusive,
            } => {
                let Some(pc) = self.link_conn(from, &vhost) else {
                    self.links.send(from, LinkMsg::Cancelled { cid });
                    return;
                };
                let Some(q) = self
                    .vhosts
                    .get_mut(&vhost)
                    .and_then(|v| v.queues.get_mut(queue.as_str()))
                else {
                    self.links.send(from, LinkMsg::Cancelled { cid });
                    return;
                };
                let tag: Arc<str> = Arc::from(cid.to_string());
                // Asked again (the origin resubscribes after a link reset
                // that this side may not have seen): one consumer.
                if q.consumers
                    .iter()
                    .any(|c| c.conn == pc && c.channel == LINK_CHANNEL && c.tag == tag)
                {
                    self.links.send(from, LinkMsg::ConsumeOk { cid });
                    return;
                }
                if let Some(text) = q.refuses_consumer(exclusive, &vhost) {
                    self.links.send(from, LinkMsg::ConsumeRefused { cid, text });
                    return;
                }
                let qname = q.name.clone();
                q.add_consumer(Consumer {
                    tag: tag.clone(),
                    conn: pc,
                    channel: LINK_CHANNEL,
                    no_ack,
                    exclusive,
                    prefetch,
                    unacked: 0,
                    reserved: 0,
                    remote_cid: 0,
                    cancel_on_failover: false,
                    priority,
                    pace: Pace::default(),
                });
                q.had_consumers = true;
                if let Some(ch) = self
                    .conns
                    .get_mut(&pc)
                    .and_then(|c| c.channels.get_mut(&LINK_CHANNEL))
                {
                    ch.consumers.insert(tag, qname.clone());
                }
                // Before its first delivery, on the same link.
                self.links.send(from, LinkMsg::ConsumeOk { cid });
                self.after_queue_op(&vhost, &qname);
            }
            LinkMsg::Reply { to, meta, body } => {
                // Dropped if the requester has gone meanwhile, as RabbitMQ's.
                self.deliver_reply(&to, &meta, &body);
            }
            LinkMsg::Cancel { vhost, cid } => {
                if let Some(pc) = self.links.conns.get(&(from.to_owned(), vhost)).copied() {
                    cancelled.extend(self.remove_consumer(pc, LINK_CHANNEL, &cid.to_string()));
                }
                // After every delivery to it, on the same link.
                self.links.send(from, LinkMsg::CancelOk { cid });
            }
            LinkMsg::CancelOk { cid } => self.answer_cancel_ok(cid),
            LinkMsg::ConsumerLeft { vhost, queue } => {
                // Counted now if this node serves the queue; else passed to
                // the master this node knows next (it may not yet know it
                // is the master itself).
                if let Some(q) = self.queue_mut(&vhost, &queue) {
                    q.consumer_left_unseen = true;
                    self.count_consumer_left(&vhost, &queue);
                }
            }
            LinkMsg::Alarms { memory, disk } => {
                self.set_remote_alarms(from, crate::AlarmSet { memory, disk });
            }
            LinkMsg::Settle { vhost, tags, how } => {
                let Some(pc) = self.links.conns.get(&(from.to_owned(), vhost)).copied() else {
                    tracing::debug!(node = %from, settled = tags.len(), "settlements for a link with no state here");
                    return;
                };
                let how = match how {
                    0 => Settle::Ack,
                    1 => Settle::Requeue,
                    _ => Settle::Discard,
                };
                self.settle_many(pc, LINK_CHANNEL, &tags, how);
            }
            LinkMsg::Get {
                vhost,
                queue,
                req,
                no_ack,
            } => {
                let Some(pc) = self.link_conn(from, &vhost) else {
                    self.links.send(from, LinkMsg::GetReply { req, msg: None });
                    return;
                };
                self.note_stale_master(from, &vhost, &queue);
                if let Some(l) = self.conns.get_mut(&pc).and_then(|c| c.link.as_mut()) {
                    l.gets.push_back(req);
                }
                let g = basic::Get {
                    queue: queue.as_str().into(),
                    no_ack,
                };
                if self.get(pc, LINK_CHANNEL, &g).is_err()
                    && let Some(c) = self.conns.get_mut(&pc)
                {
                    c.send_get_empty(LINK_CHANNEL);
                }
            }
            LinkMsg::Count { vhost, queue, req } => {
                // A declare on another node uses the queue (x-expires).
                let now = self.now;
                if let Some(q) = self.queue_mut(&vhost, &queue) {
                    q.last_used_ms = q.last_used_ms.max(now);
                }
                self.send_counted(from, &vhost, &queue, req, None);
            }
            LinkMsg::Peek { queues } => {
                let counts = queues
                    .into_iter()
                    .filter_map(|(v, n)| {
                        let q = self.vhosts.get(&v)?.queues.get(n.as_str())?;
                        let f = q.figures();
                        q.remote.is_none().then_some((v, n, f))
                    })
                    .collect();
                self.links.send(from, LinkMsg::Peeked { counts });
            }
            LinkMsg::Peeked { counts } => {
                for (v, n, f) in counts {
                    if let Some(q) = self.queue_mut(&v, &n)
                        && q.remote.as_ref().is_some_and(|at| at.is(from))
                    {
                        q.remote_figures = Some(f);
                    }
                }
            }
            // Answers to this node, as the origin.
            LinkMsg::Counted {
                req,
                messages,
                consumers,
            } => {
                if let Some(p) = self.links.counts.remove(&req) {
                    self.answer_count(p, messages, consumers);
                }
            }
            // A confirm of a publish since sent to another master (its
            // node was taken for down) still counts: the first has it.
            LinkMsg::Confirmed { ids } => {
                for id in ids {
                    if let Some((conn, ch, seq)) =
                        self.links.publishes.remove(&id).and_then(|f| f.owed)
                    {
                        confirm_one(&mut self.conns, conn, ch, seq);
                    }
                }
            }
            LinkMsg::Nacked { ids } => {
                for id in ids {
                    if self
                        .links
                        .publishes
                        .get(&id)
                        .is_some_and(|f| &*f.node == from)
                        && let Some((conn, ch, seq)) =
                            self.links.publishes.remove(&id).and_then(|f| f.owed)
                    {
                        nack_one(&mut self.conns, conn, ch, seq);
                    }
                }
            }
            LinkMsg::Deliver {
                cid,
                tag,
                redelivered,
                vhost,
                meta,
                body,
            } => self.link_deliver(from, cid, tag, redelivered, &vhost, &meta, &body),
            LinkMsg::ConsumeOk { cid } => self.answer_consume_ok(cid),
            LinkMsg::Cancelled { cid } => {
                // Its client cancelled it already: its cancel-ok follows.
                if self.links.cancel_oks.contains_key(&cid) {
                    return;
                }
                // Told it exists before it is told it is gone.
                self.answer_consume_ok(cid);
                if let Some(rc) = self.links.consumers.remove(&cid)
                    && let Some(c) = self.conns.get_mut(&rc.conn)
                {
                    if let Some(ch) = c.channels.get_mut(&rc.channel) {
                        ch.consumers.remove(&rc.tag);
                    }
                    c.cancel_consumer(rc.channel, &rc.tag);
                    if let Some(q) = self
                        .vhosts
                        .get_mut(&rc.vhost)
                        .and_then(|v| v.queues.get_mut(&rc.queue))
                    {
                        q.consumers.retain(|x| x.remote_cid != cid);
                    }
                }
            }
            LinkMsg::ConsumeRefused { cid, text } => self.consume_refused(cid, text),
            LinkMsg::Purge { vhost, queue, req } => {
                let purged = self.purge_here(&vhost, &queue).unwrap_or(0);
                self.send_counted(from, &vhost, &queue, req, Some(purged));
            }
            LinkMsg::GetReply { req, msg } => {
                let Some(get) = self.links.gets.remove(&req) else {
                    return;
                };
                let waiter = get.conn;
                self.get_reply(get, msg);
                self.reply_answered(waiter);
            }
            LinkMsg::Taken { upto } => {
                if let Some(f) = self.links.in_flight.get_mut(from) {
                    while f.front().is_some_and(|&id| id <= upto) {
                        f.pop_front();
                    }
                }
            }
        }
    }

    /// Answers a forwarded `basic.get` with the master's reply.
    fn get_reply(&mut self, get: RemoteGet, msg: Option<GetReplyMsg>) {
        let RemoteGet {
            node,
            conn,
            channel: ch,
            no_ack,
            vhost,
            queue,
            req,
            since_ms: _,
        } = get;
        let open = self
            .conns
            .get(&conn)
            .is_some_and(|c| c.channels.contains_key(&ch));
        let (Some(c), true) = (self.conns.get_mut(&conn), open) else {
            // The channel closed before the answer came: the message
            // goes back at the master, which would otherwise hold it
            // as unacknowledged for as long as the link lasts.
            if let Some((tag, ..)) = msg
                && !no_ack
            {
                self.link_settle(&Elsewhere::Node(node), &vhost, vec![tag], Settle::Requeue);
            }
            return;
        };
        c.answering_get(req);
        let Some(chan) = c.channels.get_mut(&ch) else {
            return;
        };
        let Some((tag, redelivered, meta, body, remaining)) = msg else {
            c.send_get_empty(ch);
            return;
        };
        chan.next_tag += 1;
        let dtag = chan.next_tag;
        if !no_ack {
            chan.unacked.insert(
                dtag,
                Unacked {
                    queue: queue.clone(),
                    bq_tag: tag,
                    consumer: None,
                    seq: 0,
                    remote: Some(Elsewhere::Node(node.clone())),
                    delivered_at_ms: self.now,
                },
            );
        }
        let m = decode_meta(&meta);
        c.send_message(
            ch,
            &ContentMethod::GetOk {
                delivery_tag: dtag,
                redelivered,
                exchange: m.exchange,
                routing_key: m.routing_key,
                message_count: remaining,
            },
            &m.properties,
            &meta,
            &body,
        );
        let _ = vhost;
    }

    #[allow(clippy::too_many_arguments)]
    fn link_deliver(
        &mut self,
        from: &str,
        cid: u64,
        tag: u64,
        redelivered: bool,
        vhost: &str,
        meta: &Bytes,
        body: &Bytes,
    ) {
        let rc = self.links.consumers.get(&cid).cloned();
        let mut held_on = None;
        let delivered = rc.as_ref().is_some_and(|rc| {
            let Some(c) = self.conns.get_mut(&rc.conn) else {
                return false;
            };
            let Some(chan) = c.channels.get_mut(&rc.channel) else {
                return false;
            };
            let cancelling = self.links.cancel_oks.contains_key(&cid);
            if !chan.consumers.contains_key(&rc.tag) && !cancelling {
                return false;
            }
            chan.next_tag += 1;
            let dtag = chan.next_tag;
            let node: Arc<str> = Arc::from(from);
            // Under the channel's global prefetch: sent as far as it has
            // room, behind what it holds already (`release_held`); a
            // cancelled consumer's last deliveries go at once.
            let hold = !rc.no_ack && chan.global_prefetch != 0 && !cancelling;
            if !rc.no_ack {
                chan.unacked.insert(
                    dtag,
                    Unacked {
                        queue: rc.queue.clone(),
                        bq_tag: tag,
                        consumer: Some(rc.tag.clone()),
                        seq: 0,
                        remote: Some(Elsewhere::Node(node)),
                        delivered_at_ms: self.now,
                    },
                );
            }
            if hold {
                chan.held.push_back(Held {
                    tag: dtag,
                    consumer: rc.tag.clone(),
                    redelivered,
                    meta: meta.clone(),
                    body: body.clone(),
                });
                held_on = Some((rc.conn, rc.channel));
                return true;
            }
            let m = decode_meta(meta);
            c.count_delivery(rc.channel, redelivered);
            c.amqp.send_content(
                rc.channel,
                &ContentMethod::Deliver {
                    consumer_tag: &rc.tag,
                    delivery_tag: dtag,
                    redelivered,
                    exchange: m.exchange,
                    routing_key: m.routing_key,
                },
                &m.properties,
                body,
            );
            true
        });
        if let Some((id, ch)) = held_on {
            self.release_held(id, ch);
        }
        let retired = rc.is_none()
            && self
                .links
                .retired_below
                .get(from)
                .is_some_and(|below| cid < *below);
        if !delivered {
            tracing::debug!(node = %from, cid, tag, retired, "a delivery to a consumer gone: {}", if retired { "its master requeues it" } else { "sent back" });
        }
        if !delivered && !retired {
            // The consumer is gone, or this node no longer knows it (its
            // link was reset while the delivery was on the way): the message
            // goes back at the master, which would otherwise hold it as
            // unacknowledged for ever. (For an id given before the last
            // reset of the master's link, the master does that itself.)
            self.link_settle(
                &Elsewhere::Node(Arc::from(from)),
                vhost,
                vec![tag],
                Settle::Requeue,
            );
        }
    }

    /// Node `node` is down (or its link broke): forwarded publishes it had
    /// not confirmed are sent again to their mirrored queues' next masters
    /// (or to `node` once its link is back), which confirm those they hold
    /// already; meanwhile those queues' publishes wait for them, nacked
    /// [`RESEND_WAIT_MS`] after their clients published them (and the other
    /// queues' forwarded publishes are nacked at once). Its deliveries to
    /// this node's clients settle nowhere (its successor redelivers them),
    /// and its forwarded consumers and unacked deliveries on this node's
    /// queues are dropped (requeued); this node's consumers of its queues
    /// get new ids, asked for on the next session (`renumber_consumers`).
    pub fn link_down(&mut self, node: &str, now_ms: u64) {
        self.drop_link(node, now_ms, true);
    }

    /// Node `node` started a new link session to this node (its own link
    /// to this node broke, and it dropped this node's link state then): as
    /// [`link_down`](Self::link_down), except that this node's consumers
    /// keep their ids, since `node` serves those asked for since.
    pub fn link_replaced(&mut self, node: &str, now_ms: u64) {
        self.drop_link(node, now_ms, false);
    }

    fn drop_link(&mut self, node: &str, now_ms: u64, down: bool) {
        self.detached(|b| {
            b.now = now_ms;
            b.current = 0;
            let again = b.drop_origin_state(node);
            b.expire_cancel_oks(now_ms, Some(node));
            if down {
                b.renumber_consumers(node);
            }
            b.link_peer_restarted(node);
            b.out_link_dropped(node);
            if down {
                b.hold_for_master_down(node);
            }
            b.end_old_master_waits();
            // To the next master, if there is one already (or to `node`
            // over its new session, after a reset).
            for (vhost, queue) in again {
                b.unpark(&vhost, &queue);
            }
        });
    }

    /// Holds work for the mirrored queues mastered on `node`, whose link is
    /// down, until a new master is named or the link is back
    /// ([`Broker::resubscribe`]), at most [`super::parked::PARK_LIMIT_MS`]
    /// (publishes at most [`RESEND_WAIT_MS`] each): sent to `node` now, it
    /// would fail again at once.
    fn hold_for_master_down(&mut self, node: &str) {
        let until = self.now + super::parked::PARK_LIMIT_MS;
        let mut held = Vec::new();
        for (vhost, v) in &self.vhosts {
            for (name, q) in &v.queues {
                if q.remote.as_ref().is_some_and(|at| at.is(node)) {
                    held.push((vhost.clone(), name.clone(), q.opts.exclusive));
                }
            }
        }
        for (vhost, name, exclusive) in held {
            if self.queue_policy(&vhost, &name, exclusive).ha.is_none() {
                continue;
            }
            if let Some(q) = self.queue_mut(&vhost, &name) {
                q.master_down = Some((Arc::from(node), until));
            }
        }
    }

    /// Node `node` started a new link session to this node after giving up
    /// its link state with this node at a time it had not yet heard this
    /// node's current session (`LinkMsg::Hello`'s `gave_up`): its work here
    /// goes, with what it had delivered to this node's clients, but this
    /// node's work forwarded on the current session reached `node` after
    /// its give-up and stands (no publish of it is nacked).
    pub fn link_peer_gave_up(&mut self, node: &str) {
        self.detached(|b| {
            b.current = 0;
            b.deliveries_settle_nowhere(node);
            b.forget_peer_run(node);
        });
    }

    /// Node `node` restarted and has received everything this node sent it
    /// since (see `LinkMsg::Hello`): only what its previous run had here
    /// goes (its consumers of this node's queues, its forwarded work,
    /// its alarms); this node's work forwarded to it stands.
    pub fn link_peer_restarted(&mut self, node: &str) {
        self.detached(|b| b.forget_peer_run(node));
    }

    fn forget_peer_run(&mut self, node: &str) {
        self.current = 0;
        self.set_remote_alarms(node, crate::AlarmSet::default());
        let gone: Vec<ConnId> = self
            .links
            .conns
            .iter()
            .filter(|((n, _), _)| n == node)
            .map(|(_, id)| *id)
            .collect();
        self.links.conns.retain(|(n, _), _| n != node);
        for id in gone {
            self.cleanup_conn(id);
            self.conns.remove(&id);
        }
        self.wake_clients();
    }

    /// This node's work forwarded to `node` is lost: publishes held to be
    /// sent again (mirrored queues, within [`RESEND_WAIT_MS`] of their
    /// publish; returns their queues) or nacked, gets answered empty, its
    /// deliveries settle nowhere.
    fn drop_origin_state(&mut self, node: &str) -> Vec<(String, Arc<str>)> {
        let lost: Vec<u64> = self
            .links
            .publishes
            .iter()
            .filter(|(_, p)| &*p.node == node)
            .map(|(id, _)| *id)
            .collect();
        let mut again: Vec<(u64, Forwarded)> = Vec::new();
        for id in lost {
            let Some(f) = self.links.publishes.remove(&id) else {
                continue;
            };
            if self.may_send_again(&f) {
                again.push((id, f));
            } else if let Some((conn, ch, seq)) = f.owed {
                nack_one(&mut self.conns, conn, ch, seq);
            }
        }
        // Per queue, in the order they were sent.
        again.sort_unstable_by(|(a, fa), (b, fb)| {
            (&fa.vhost, &fa.queue, a).cmp(&(&fb.vhost, &fb.queue, b))
        });
        let mut queues: Vec<(String, Arc<str>)> = Vec::new();
        let mut rest = again.into_iter().peekable();
        while let Some((id, f)) = rest.next() {
            let (vhost, queue) = (f.vhost.clone(), f.queue.clone());
            let mut fs = vec![(id, f)];
            while let Some((id, f)) = rest.next_if(|(_, n)| n.vhost == vhost && n.queue == queue) {
                fs.push((id, f));
            }
            let sent = fs.into_iter().map(|(_, f)| {
                let msg = Msg {
                    sent: Some(Sent::Again {
                        id: f.identity,
                        since_ms: f.since_ms,
                    }),
                    ..f.msg
                };
                (msg, f.owed, f.since_ms + RESEND_WAIT_MS)
            });
            self.park_first(&vhost, &queue, sent);
            queues.push((vhost, queue));
        }
        let gets: Vec<RemoteGet> = self
            .links
            .gets
            .extract_if(|_, g| &*g.node == node)
            .map(|(_, g)| g)
            .collect();
        for g in gets {
            if let Some(c) = self.conns.get_mut(&g.conn) {
                c.answering_get(g.req);
                c.send_get_empty(g.channel);
            }
            self.reply_answered(g.conn);
        }
        // Consumes waiting for it are answered: the consumers stay, and are
        // asked for again on the next link session (`resubscribe`) or at
        // the queue's next master.
        let waiting: Vec<u64> = self
            .links
            .consume_oks
            .keys()
            .copied()
            .filter(|cid| {
                self.links.consumers.get(cid).is_some_and(|rc| {
                    self.vhosts
                        .get(&rc.vhost)
                        .and_then(|v| v.queues.get(&rc.queue))
                        .is_none_or(|q| q.remote.as_ref().is_none_or(|at| at.is(node)))
                })
            })
            .collect();
        for cid in waiting {
            self.answer_consume_ok(cid);
        }
        // Declares waiting for its counts keep waiting: asked again on the
        // next link session (`resubscribe`), of the next master if the queue
        // fails over (`set_queue_master`), or answered by this node after
        // COUNT_WAIT_MS (`expire_counts`).
        self.deliveries_settle_nowhere(node);
        queues
    }

    /// Whether forwarded publish `f`, whose master's node went down before
    /// confirming it, waits for the next master: its queue is mirrored (a
    /// mirror may hold it, or take it over) and it is recent.
    fn may_send_again(&self, f: &Forwarded) -> bool {
        let Some(q) = self
            .vhosts
            .get(&f.vhost)
            .and_then(|v| v.queues.get(&f.queue))
        else {
            return false;
        };
        self.now < f.since_ms + RESEND_WAIT_MS
            && self
                .queue_policy(&f.vhost, &f.queue, q.opts.exclusive)
                .ha
                .is_some()
    }

    /// `node`'s deliveries to this node's clients stay known to their
    /// channels (a client acking one must not get "unknown delivery tag"),
    /// but settle nowhere: `node` requeued them when it dropped this
    /// node's link state, and the queue's master delivers them again,
    /// redelivered.
    fn deliveries_settle_nowhere(&mut self, node: &str) {
        let mut release = Vec::new();
        for (id, c) in &mut self.conns {
            for (ch, chan) in &mut c.channels {
                for u in chan.unacked.values_mut() {
                    if u.remote.as_ref().is_some_and(|at| at.is(node)) {
                        u.remote = Some(Elsewhere::Nowhere);
                    }
                }
                // Those its global prefetch held back were never sent: gone
                // (the next master delivers them), and the rest may go now.
                if !chan.held.is_empty() {
                    let unacked = &mut chan.unacked;
                    chan.held.retain(|h| {
                        let gone = unacked
                            .get(&h.tag)
                            .is_some_and(|u| matches!(u.remote, Some(Elsewhere::Nowhere)));
                        if gone {
                            unacked.remove(&h.tag);
                        }
                        !gone
                    });
                    release.push((*id, *ch));
                }
            }
        }
        for (id, ch) in release {
            self.release_held(id, ch);
        }
    }

    /// Gives this node's consumers of `node`'s queues new ids, asked for on
    /// the next link session (`resubscribe`). Deliveries `node` sent to the
    /// old ids may still be on their way (over a connection of its own that
    /// outlived the reset): `node` requeues them, redelivered, when it drops
    /// this node's link state, so they are dropped here (`link_deliver`),
    /// not handed to a client as first deliveries.
    fn renumber_consumers(&mut self, node: &str) {
        let threshold = self.links.next_id + 1;
        self.links.retired_below.insert(node.to_owned(), threshold);
        let ids: Vec<u64> = self
            .links
            .consumers
            .iter()
            .filter(|(_, rc)| {
                self.vhosts
                    .get(&rc.vhost)
                    .and_then(|v| v.queues.get(&rc.queue))
                    .is_some_and(|q| q.remote.as_ref().is_some_and(|at| at.is(node)))
            })
            .map(|(cid, _)| *cid)
            .collect();
        for old in ids {
            let Some(rc) = self.links.consumers.remove(&old) else {
                continue;
            };
            let new = self.links.next();
            if let Some(c) = self
                .vhosts
                .get_mut(&rc.vhost)
                .and_then(|v| v.queues.get_mut(&rc.queue))
                .and_then(|q| q.consumers.iter_mut().find(|c| c.remote_cid == old))
            {
                c.remote_cid = new;
                // What the old session delivered is settled nowhere.
                c.unacked = 0;
                c.reserved = 0;
            }
            self.links.consumers.insert(new, rc);
        }
    }

    fn out_link_dropped(&mut self, node: &str) {
        self.links.out.remove(node);
        // The next session is a new stream.
        self.links.streams.remove(node);
        // Lost with the link, or nacked (`drop_origin_state`).
        self.links.in_flight.remove(node);
    }
}

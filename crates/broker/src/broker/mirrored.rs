//! Mirrored queues inside the broker: a queue's messages live either in a
//! local [`BackingQueue`] or in a [`Replica`] (master or mirror) of a
//! mirrored queue, driven here under the broker's lock.
//!
//! The replica is sans-IO. The broker calls it for every client operation
//! on the queue and handles its outputs at once (confirms, nacks, fetched
//! deliveries). Ring traffic and queue-record changes go through the shell:
//! [`Broker::mirror_input`] feeds what the ring and the metadata store said,
//! [`Broker::take_mirror_io`] hands over what must be broadcast and which
//! record compare-and-sets to run, and the queue's [`Waker`] says when there
//! is some.

use std::sync::Arc;

use bytes::Bytes;
use warren_amqp::{ChannelId, ContentMethod};
use warren_backing_queue::{
    BackingQueue, Delivery, DeliveryTag, Dropped, Stats, SyncJob, UnsyncedHook,
};
use warren_gm::{MemberId, RingEvent, View};
use warren_mirror::{
    HeldPublishes, Output, PublishId, QueueFactory, RecordView, Replica, Role, Settings, Status,
};

use super::link::Elsewhere;
use super::{Broker, ConnId, IdMap, Unacked, Waker, confirm_one};
use crate::routing::decode_meta;

/// Where a queue's messages live. (Most queues are local: the backing
/// queue stays inline, the rarer replica is boxed.)
#[allow(clippy::large_enum_variant)]
pub(crate) enum Store {
    /// A queue that is not mirrored.
    Local(BackingQueue),
    /// A replica of a mirrored queue.
    Replica(Box<Mirrored>),
}

/// A mirrored queue's replica and what the broker keeps around it.
pub(crate) struct Mirrored {
    pub(crate) replica: Replica,
    /// The queue's ring (its GM ring name).
    ring: String,
    /// Wakes the shell task that moves this replica's ring traffic.
    waker: Waker,
    /// Broadcasts waiting for the shell.
    outbox: Vec<Bytes>,
    /// Point-to-point messages to ring members waiting for the shell.
    sends: Vec<(MemberId, Bytes)>,
    /// Record compare-and-sets waiting for the shell.
    proposals: Vec<(u64, RecordView)>,
    /// Who a pending fetch is for, by token.
    fetches: IdMap<u64, FetchFor>,
    /// The confirm a publish owes, by publish id.
    publishes: IdMap<PublishId, (ConnId, ChannelId, u64)>,
    /// More confirms a publish owes: it came again (sent again by its
    /// origin, and passed on by the old master's node) while it waited.
    also: IdMap<PublishId, Vec<(ConnId, ChannelId, u64)>>,
    /// Messages the master dropped, for dead-lettering.
    dropped: Vec<Dropped>,
    /// Whether the replica was this queue's master when it last acted (not
    /// deposed): a stopped replica's role no longer says.
    master: bool,
}

/// Who gets a fetched message.
#[derive(Debug, Clone)]
enum FetchFor {
    Consumer {
        conn: ConnId,
        channel: ChannelId,
        tag: Arc<str>,
        no_ack: bool,
    },
    Get {
        conn: ConnId,
        channel: ChannelId,
        no_ack: bool,
        /// On a forwarding link: the origin's request the answer is for.
        req: Option<u64>,
    },
}

/// What the shell must do for one replica: broadcast on its ring, and run
/// record compare-and-sets (feed each outcome back with
/// [`MirrorInput::RecordSettled`]).
#[derive(Debug, Default)]
pub struct MirrorIo {
    /// Payloads to broadcast on the ring, in order.
    pub broadcasts: Vec<Bytes>,
    /// Payloads to send to one ring member each (a mirror's disk reports).
    pub sends: Vec<(MemberId, Bytes)>,
    /// `(expected_version, placement)` compare-and-sets of the queue record.
    pub proposals: Vec<(u64, RecordView)>,
    /// Whether the replica has stopped (deposed, removed, or stop requested):
    /// leave the ring once `broadcasts` are sent.
    pub stopped: bool,
    /// Whether it was a master that stopped because its disk failed
    /// ([`Replica::storage_failed`](warren_mirror::Replica::storage_failed)).
    pub storage_failed: bool,
}

/// What the shell feeds a replica.
#[derive(Debug)]
pub enum MirrorInput {
    /// Ring events (deliveries, confirms, removal). A `View` event must be
    /// replaced by [`MirrorInput::View`] with the view read from the authority.
    Ring(Vec<RingEvent>),
    /// The ring installed this view.
    View(View),
    /// The queue record changed (or was read).
    Record(RecordView),
    /// A proposed compare-and-set finished: the record it wrote, or the
    /// current one.
    RecordSettled(RecordView),
    /// Time passed (TTL expiry, sync pacing).
    Tick,
    /// Stop cleanly (a master hands over to its mirrors).
    Stop,
    /// Whether this node sees a majority of the cluster
    /// ([`Replica::set_isolated`](warren_mirror::Replica::set_isolated)).
    Majority(bool),
}

/// How to start a replica in [`Broker::start_replica`].
pub struct ReplicaStart {
    /// The queue it replicates: this broker's queue of that id
    /// ([`Broker::queue_uid`]). A queue deleted and declared again since is
    /// another queue, and is not taken.
    pub queue: u64,
    /// The ring's name.
    pub ring: String,
    /// This node's ring member.
    pub member: MemberId,
    /// Mirroring settings from the queue's policy.
    pub settings: Settings,
    /// The queue record as claimed (master: naming this node master).
    pub record: RecordView,
    /// Start as master (keeping the local messages) or as mirror (dropping them).
    pub master: bool,
    /// Wakes the shell task of this replica.
    pub waker: Waker,
}

/// What a master's queue becomes when its replica ends ([`Broker::end_replica`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaEnd {
    /// The queue stops being mirrored: the master serves its messages alone.
    Serve,
    /// This node is stopping: the messages stay on its disk for a restart,
    /// and the queue takes no more work here (publishes are nacked).
    Keep,
    /// Handed over to another master: the messages are dropped.
    Drop,
    /// The master's replica ended by itself (removed from its ring) while
    /// the queue is still mirrored and its record counts other nodes'
    /// mirrors synchronised: the messages stay, unserved (as
    /// [`Broker::hold_for_replica`] holds them), for the replica that
    /// starts here next as master, or go once the record names another
    /// master. Served meanwhile, they would change outside the ring while
    /// one of those mirrors may be promoted.
    Hold,
    /// This node's disk failed under the master: its copy in memory cannot
    /// be trusted (the log is poisoned) and goes; the log stays on disk,
    /// and the queue takes no work here until it is opened again from it
    /// ([`Broker::restore_queue`]) or another node's replica takes over.
    Failed,
}

impl std::fmt::Debug for ReplicaStart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaStart")
            .field("queue", &self.queue)
            .field("ring", &self.ring)
            .field("member", &self.member)
            .field("master", &self.master)
            .finish_non_exhaustive()
    }
}

fn err_text(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl Store {
    /// A replica's ring: its view version and the messages sent around it
    /// that not every member has acknowledged yet (`None` unmirrored).
    pub(crate) fn ring(&self) -> Option<crate::RingInfo> {
        match self {
            Store::Local(_) => None,
            Store::Replica(m) => Some(crate::RingInfo {
                view: m.replica.status().epoch,
                pending: m.replica.backlog() as u64,
            }),
        }
    }

    /// Message counts (a replica that holds nothing counts zero).
    pub(crate) fn stats(&self) -> Stats {
        match self {
            Store::Local(bq) => bq.stats(),
            Store::Replica(m) => m.replica.stats().unwrap_or_default(),
        }
    }

    /// Whether this node serves the queue's clients (not a mirror).
    pub(crate) fn serves(&self) -> bool {
        match self {
            Store::Local(_) => true,
            Store::Replica(m) => m.replica.role() == Role::Master,
        }
    }

    pub(crate) fn ack(&mut self, tag: DeliveryTag) -> Result<(), String> {
        match self {
            Store::Local(bq) => bq.ack(tag).map_err(err_text),
            Store::Replica(m) => m.replica.ack(tag).map_err(err_text),
        }
    }

    pub(crate) fn requeue(&mut self, tag: DeliveryTag) -> Result<(), String> {
        match self {
            Store::Local(bq) => bq.requeue(tag).map_err(err_text),
            Store::Replica(m) => m.replica.requeue(tag).map_err(err_text),
        }
    }

    pub(crate) fn discard(&mut self, tag: DeliveryTag) -> Result<(), String> {
        match self {
            Store::Local(bq) => bq.discard(tag).map_err(err_text),
            Store::Replica(m) => m.replica.discard(tag).map_err(err_text),
        }
    }

    pub(crate) fn purge(&mut self) -> Result<u64, String> {
        match self {
            Store::Local(bq) => bq.purge().map_err(err_text),
            Store::Replica(m) => m.replica.purge().map_err(err_text),
        }
    }

    pub(crate) fn awaits_sync(&self) -> bool {
        match self {
            Store::Local(bq) => bq.awaits_sync(),
            Store::Replica(m) => m.replica.awaits_storage_sync(),
        }
    }

    /// Sets the unsynced hook of a local store's backing queue (a
    /// replica's are set by its factory, `Broker::start_replica`).
    pub(crate) fn on_unsynced(&mut self, hook: UnsyncedHook) {
        if let Store::Local(bq) = self {
            bq.on_unsynced(hook);
        }
    }

    /// Arms the backing queue's unsynced hook again; whether it called it.
    pub(crate) fn arm_unsynced(&mut self) -> bool {
        match self {
            Store::Local(bq) => bq.arm_unsynced(),
            Store::Replica(m) => m.replica.arm_storage_unsynced(),
        }
    }

    /// Calls the unsynced hook if a change failed to; whether it did.
    pub(crate) fn tell_unsynced(&mut self) -> bool {
        match self {
            Store::Local(bq) => bq.tell_unsynced(),
            Store::Replica(m) => m.replica.tell_storage_unsynced(),
        }
    }

    pub(crate) fn needs_sync(&self) -> bool {
        match self {
            Store::Local(bq) => bq.needs_sync(),
            Store::Replica(m) => m.replica.needs_storage_sync(),
        }
    }

    /// Inline group commit (shutdown).
    pub(crate) fn sync(&mut self) -> Result<(), String> {
        match self {
            Store::Local(bq) => bq.sync().map(|_| ()).map_err(err_text),
            Store::Replica(m) => m.replica.sync_storage().map_err(err_text),
        }
    }

    pub(crate) fn prepare_sync(&mut self) -> Result<Option<SyncJob>, String> {
        match self {
            Store::Local(bq) => bq.prepare_sync().map_err(err_text),
            Store::Replica(m) => m.replica.prepare_storage_sync().map_err(err_text),
        }
    }

    pub(crate) fn next_expiry_ms(&self) -> Option<u64> {
        match self {
            Store::Local(bq) => bq.next_expiry_ms(),
            Store::Replica(m) => m.replica.next_timer_ms(),
        }
    }

    pub(crate) fn expire(&mut self, now_ms: u64) -> Result<(), String> {
        match self {
            Store::Local(bq) => bq.expire(now_ms).map_err(err_text),
            Store::Replica(m) => {
                m.replica.tick(now_ms);
                Ok(())
            }
        }
    }

    /// Changes how many body bytes the store keeps in memory (a policy
    /// changed the queue's mode).
    pub(crate) fn set_resident_bytes_max(&mut self, bytes: u64) {
        match self {
            Store::Local(bq) => {
                if let Err(e) = bq.set_resident_bytes_max(bytes) {
                    tracing::warn!(error = %e, "paging a queue out failed: its messages stay in memory");
                }
            }
            Store::Replica(m) => m.replica.set_resident_bytes_max(bytes),
        }
    }

    /// Changes the store's limits (a policy changed); a mirror ignores it
    /// (its master's change comes round the ring).
    pub(crate) fn set_limits(
        &mut self,
        limits: warren_backing_queue::Limits,
    ) -> Result<(), String> {
        match self {
            Store::Local(bq) => bq.set_limits(limits).map_err(err_text),
            Store::Replica(m) if m.replica.role() == Role::Master => {
                m.replica.set_limits(limits).map_err(err_text)
            }
            Store::Replica(_) => Ok(()),
        }
    }

    pub(crate) fn take_dropped(&mut self, out: &mut Vec<Dropped>) {
        match self {
            Store::Local(bq) => bq.take_dropped(out),
            Store::Replica(m) => out.append(&mut m.dropped),
        }
    }

    /// The replica's status, for a mirrored queue.
    pub(crate) fn mirror_status(&self) -> Option<Status> {
        match self {
            Store::Local(_) => None,
            Store::Replica(m) => Some(m.replica.status()),
        }
    }

    /// The digest of the messages this store holds (`None`: a mirror that
    /// holds no copy yet).
    pub(crate) fn digest(&self) -> Option<u64> {
        match self {
            Store::Local(bq) => Some(bq.digest()),
            Store::Replica(m) => m.replica.digest(),
        }
    }
}

/// A mirrored queue with this many publishes and fetches waiting for its
/// ring, or publishes of [`BACKLOG_HIGH_BYTES`], holds publishers back until
/// it is under [`BACKLOG_LOW`] and [`BACKLOG_LOW_BYTES`].
const BACKLOG_HIGH: usize = 4_000;
/// See [`BACKLOG_HIGH`].
const BACKLOG_LOW: usize = 2_000;
/// See [`BACKLOG_HIGH`]: large messages count by their size (4,000 of
/// 1 MiB on the ring at once held 4 GiB in memory). 16 MiB keeps 1 MiB
/// messages flowing as fast as 64 did, with a quarter of the latency:
/// 3 nodes, RabbitMQ's Java client, 1 MiB transient, auto-ack, 357 msg/s
/// and e2e p50 70 ms against 335 and 197 ms (docs/benchmarks.md).
const BACKLOG_HIGH_BYTES: usize = 16 << 20;
/// See [`BACKLOG_HIGH`].
const BACKLOG_LOW_BYTES: usize = 8 << 20;

impl Broker {
    /// Whether connection `id` must wait before more of its input is read:
    /// it publishes, is not closing, and a queue it publishes into is
    /// behind: its ring (a mirrored queue's), its consumers (see
    /// [`Self::lags`]) or the link to its master's node (flow control; a
    /// stopped reader is what RabbitMQ's credit flow does too); or a
    /// resource alarm is in force. One backlogged queue or link holds back
    /// only the publishers that send into it. Any connection waits while
    /// its last command waits for its metadata commit (`commits.rs`).
    #[must_use]
    pub fn input_paused(&self, id: ConnId) -> bool {
        if self
            .conns
            .get(&id)
            .is_some_and(|c| c.committing.is_some() || c.replies_waiting > 0)
        {
            return true;
        }
        let Some(c) = self
            .conns
            .get(&id)
            .filter(|c| c.publisher && c.link.is_none() && !c.amqp.is_closing())
        else {
            return false;
        };
        self.alarmed()
            || c.targets.iter().any(|q| {
                self.lags(&c.vhost, q)
                    || self.ring_behind(&c.vhost, q)
                    || self.master_link_behind(&c.vhost, q)
            })
    }

    /// Whether queue `name` is served on another node whose link is behind,
    /// or which has not yet taken in enough of this node's publishes.
    fn master_link_behind(&self, vhost: &str, name: &str) -> bool {
        self.vhosts
            .get(vhost)
            .and_then(|v| v.queues.get(name))
            .and_then(|q| q.remote.as_ref()?.node())
            .is_some_and(|node| self.link_behind(node) || self.link_publishes_behind(node))
    }

    /// Whether queue `name` holds its publishers back: its consumers are
    /// taking messages (one was delivered or settled within
    /// `FLOW_ACTIVE_MS`) but fall behind (more than `FLOW_READY_MAX` ready).
    #[must_use]
    pub fn lags(&self, vhost: &str, name: &str) -> bool {
        self.vhosts
            .get(vhost)
            .and_then(|v| v.queues.get(name))
            .is_some_and(|q| {
                q.remote.is_none()
                    && !q.consumers.is_empty()
                    && self
                        .now
                        .saturating_sub(q.delivered_at_ms.max(q.settled_at_ms))
                        < super::FLOW_ACTIVE_MS
                    && {
                        let s = q.store.stats();
                        s.ready > super::FLOW_READY_MAX
                            || s.ready_bytes > super::FLOW_READY_BYTES_MAX
                    }
            })
    }

    /// Whether a publish into queue `name` forwarded from node `from` must
    /// wait: the queue's ring is behind (more than `BACKLOG_HIGH` publishes
    /// and fetches waiting for it, until under `BACKLOG_LOW`), or its
    /// consumers are (see [`Self::lags`]), or the link back to `from` (its
    /// confirm's way) is.
    #[must_use]
    pub fn publish_waits(&self, from: &str, vhost: &str, name: &str) -> bool {
        self.link_behind(from) || self.ring_behind(vhost, name) || self.lags(vhost, name)
    }

    fn ring_behind(&self, vhost: &str, name: &str) -> bool {
        self.backlogged
            .iter()
            .any(|(v, q)| v == vhost && &**q == name)
    }

    /// Turns queue `name` of `vhost` into a replica of a mirrored queue: as
    /// master it keeps the local messages, as mirror it starts empty (its old
    /// content is deleted). `factory` makes the mirror's fresh backing queue.
    /// Returns false if there is no such queue or it already is a replica.
    pub fn start_replica(
        &mut self,
        vhost: &str,
        name: &str,
        start: ReplicaStart,
        factory: QueueFactory,
    ) -> bool {
        // Every backing queue the replica makes tells the group commit.
        let unsynced = self.unsynced.clone();
        let hook = (self.vhosts.get(vhost).and_then(|v| v.queues.get(name)))
            .map(|q| unsynced.hook(vhost, &q.name, q.uid));
        let factory: QueueFactory = match hook {
            Some(hook) => {
                let mut make = factory;
                Box::new(move |cfg| {
                    let mut bq = make(cfg)?;
                    bq.on_unsynced(Arc::clone(&hook));
                    Ok(bq)
                })
            }
            None => factory,
        };
        let node = self.cfg.node_name.clone();
        if start.master
            && self
                .queue_mut(vhost, name)
                .is_some_and(|q| q.uid == start.queue && !q.opts.exclusive)
        {
            self.requeue_orphans(vhost, name);
        }
        let Some(q) = self
            .vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(name))
        else {
            return false;
        };
        if q.uid != start.queue || matches!(q.store, Store::Replica(_)) || q.opts.exclusive {
            return false;
        }
        if start.master {
            q.handed_over = false;
            q.held_for_replica = false;
            q.remote = None;
        }
        let placeholder = Store::Local(BackingQueue::in_memory(Default::default()));
        let Store::Local(bq) = std::mem::replace(&mut q.store, placeholder) else {
            return false;
        };
        // Expired, rejected and overflowed messages come back to the broker,
        // which dead-letters them if the queue (or a policy) says where.
        let mut settings = start.settings;
        settings.report_dropped = true;
        settings.max_priority = q.max_priority;
        let mut voided = false;
        let replica = if start.master {
            Replica::new_master(
                name,
                node,
                start.member,
                settings,
                factory,
                bq,
                std::mem::take(&mut q.kept_held),
                start.record,
            )
        } else {
            // Its messages go with it (the master's are the queue's): what
            // still waited for a confirm never gets one.
            drop(bq);
            voided = true;
            for (_, conn, ch, cseq) in std::mem::take(&mut q.confirms) {
                nack_one(&mut self.conns, conn, ch, cseq);
            }
            Replica::new_mirror(name, node, start.member, settings, factory, start.record)
        };
        q.store = Store::Replica(Box::new(Mirrored {
            replica,
            ring: start.ring,
            waker: start.waker,
            outbox: Vec::new(),
            sends: Vec::new(),
            proposals: Vec::new(),
            fetches: IdMap::default(),
            publishes: IdMap::default(),
            also: IdMap::default(),
            dropped: Vec::new(),
            master: start.master,
        }));
        if voided {
            self.void_deliveries(vhost, name);
        }
        self.mirror_turn(vhost, name);
        true
    }

    /// Ends queue `name`'s replica after its ring member left; what a master
    /// does with its messages is `end`'s (a mirror's content is dropped, and
    /// the queue is served from its master). Pending publishes are nacked.
    pub fn end_replica(
        &mut self,
        vhost: &str,
        name: &str,
        factory: &mut QueueFactory,
        end: ReplicaEnd,
    ) {
        let Some(q) = self
            .vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(name))
        else {
            return;
        };
        if !matches!(q.store, Store::Replica(_)) {
            return;
        }
        let Store::Replica(m) = std::mem::replace(
            &mut q.store,
            Store::Local(BackingQueue::in_memory(Default::default())),
        ) else {
            return;
        };
        let mut m = *m;
        let pending: Vec<(ConnId, ChannelId, u64)> = m.owed_confirms().collect();
        // Fetches that will never finish: give their consumers' credit back
        // (gets are answered empty).
        let qname = q.name.clone();
        let mut answered = Vec::new();
        for (_, f) in m.fetches.drain() {
            answered.extend(f.getter());
            hand_out(
                &mut self.conns,
                q.consumers.as_mut_slice(),
                &qname,
                f,
                None,
                0,
                self.now,
            );
        }
        // A mirror whose claim to the master's place landed after it left
        // its ring (the driver found the record naming this node) keeps
        // its copy as a master does: that copy is the queue's.
        let kept = matches!(end, ReplicaEnd::Serve | ReplicaEnd::Keep | ReplicaEnd::Hold);
        let was_master = m.master || (m.replica.promoting() && kept);
        let held = m.replica.held().clone();
        let bq = m.replica.into_queue().filter(|_| was_master && kept);
        if was_master && end != ReplicaEnd::Serve {
            // Handed over, held, or this node is stopping: no more work
            // here (a publish accepted now would be on this disk alone);
            // served by the new master once the record names it, or by
            // this node's next replica.
            q.handed_over = true;
            q.held_for_replica = end == ReplicaEnd::Hold;
            q.remote = Some(Elsewhere::Nowhere);
            if end == ReplicaEnd::Hold {
                tracing::info!(%vhost, queue = %name, "master removed from its ring: queue held until this node's next replica or a new master");
            }
        }
        let cfg = q.queue_config();
        let replaced = bq.is_none();
        // What the kept copy holds goes with it; a fresh store holds
        // nothing; a log left on a failed disk, not known.
        q.kept_held = match (&bq, end) {
            (Some(_), _) => held,
            (None, ReplicaEnd::Failed) => HeldPublishes::unknown(),
            (None, _) => HeldPublishes::new(),
        };
        q.store = match bq {
            Some(bq) => Store::Local(bq),
            // Its log stays as it is on disk, for `restore_queue`.
            None if end == ReplicaEnd::Failed => Store::Local(BackingQueue::in_memory(cfg)),
            None => match factory(cfg) {
                Ok(bq) => Store::Local(bq),
                Err(e) => {
                    tracing::error!(%vhost, queue = %name, error = %e, "could not reopen the queue's store");
                    Store::Local(BackingQueue::in_memory(Default::default()))
                }
            },
        };
        self.hook_unsynced(vhost, name);
        if replaced {
            self.void_deliveries(vhost, name);
        } else {
            // Fetches the ring had confirmed but the broker had not yet
            // handed out are gone with the replica: back in the kept copy.
            self.requeue_orphans(vhost, name);
        }
        for (conn, ch, cseq) in pending {
            nack_one(&mut self.conns, conn, ch, cseq);
        }
        self.after_queue_op(vhost, name);
        self.unpark(vhost, name);
        self.wake_clients();
        for conn in answered {
            self.reply_answered(conn);
        }
    }

    /// Gives queue `name`, whose master's disk failed
    /// ([`ReplicaEnd::Failed`]), the messages `bq` opened again from its
    /// log. It serves them once its replica starts again as master; with
    /// `serve` (no longer mirrored) at once. Returns false if there is no
    /// such queue or it is a replica again.
    pub fn restore_queue(
        &mut self,
        vhost: &str,
        name: &str,
        bq: BackingQueue,
        serve: bool,
    ) -> bool {
        let unsynced = self.unsynced.clone();
        let Some(q) = self.queue_mut(vhost, name) else {
            return false;
        };
        if matches!(q.store, Store::Replica(_)) {
            return false;
        }
        let hook = unsynced.hook(vhost, &q.name, q.uid);
        q.store = Store::Local(bq);
        q.kept_held = HeldPublishes::unknown();
        q.store.on_unsynced(hook);
        if serve {
            q.handed_over = false;
            q.held_for_replica = false;
            q.remote = None;
        }
        self.void_deliveries(vhost, name);
        self.after_queue_op(vhost, name);
        self.wake_clients();
        true
    }

    /// Holds queue `name`, recovered from this node's disk while the cluster
    /// names this node its master, until its replica starts as master
    /// ([`Self::start_replica`]): served from the local store meanwhile,
    /// its deliveries, acks and publishes would bypass the ring, unseen by
    /// the mirrors its record counts synchronised, one of which may yet be
    /// promoted. Meanwhile publishes are held (`parked`), gets come back
    /// empty and consumers wait, as while a queue has no master.
    pub fn hold_for_replica(&mut self, vhost: &str, name: &str) {
        let Some(q) = self.queue_mut(vhost, name) else {
            return;
        };
        if matches!(q.store, Store::Replica(_)) || q.handed_over {
            return;
        }
        tracing::info!(%vhost, queue = %name, "queue held until its mirrored master starts");
        q.handed_over = true;
        q.held_for_replica = true;
        q.remote = Some(Elsewhere::Nowhere);
    }

    /// Serves queue `name` from this node's store after all if it is held
    /// by [`Self::hold_for_replica`] and no longer mirrored, this node
    /// still its master: no replica will start to serve it.
    pub fn serve_unmirrored(&mut self, vhost: &str, name: &str) {
        let Some(q) = self.queue_mut(vhost, name) else {
            return;
        };
        if !q.held_for_replica || matches!(q.store, Store::Replica(_)) {
            return;
        }
        tracing::info!(%vhost, queue = %name, "queue no longer mirrored: served by this node");
        q.handed_over = false;
        q.held_for_replica = false;
        q.remote = None;
        self.after_queue_op(vhost, name);
        self.unpark(vhost, name);
        self.wake_clients();
    }

    /// Requeues, redelivered, what queue `name`'s local copy counts
    /// delivered but no channel here holds (a client's or a forwarding
    /// link's): when a master's replica ends with its copy kept (a fetch
    /// the ring confirmed but the broker never handed out), and before a
    /// kept copy serves again as a new master's (a client's ack or close
    /// while its replica had stopped settled nothing). Such a message would
    /// otherwise stay unacknowledged for ever (chaos seeds 41 and 46 with
    /// four queues: 8–16 of them).
    fn requeue_orphans(&mut self, vhost: &str, name: &str) {
        let held: std::collections::HashSet<u64> = self
            .conns
            .values()
            .filter(|c| c.vhost == vhost)
            .flat_map(|c| c.channels.values())
            .flat_map(|ch| ch.unacked.values())
            .filter(|u| u.remote.is_none() && &*u.queue == name)
            .map(|u| u.bq_tag)
            .collect();
        let Some(q) = self.queue_mut(vhost, name) else {
            return;
        };
        let Store::Local(bq) = &mut q.store else {
            return;
        };
        let orphans: Vec<u64> = bq
            .unacked_tags()
            .into_iter()
            .filter(|t| !held.contains(t))
            .collect();
        if orphans.is_empty() {
            return;
        }
        tracing::info!(%vhost, queue = %name, requeued = orphans.len(), "deliveries nobody holds requeued");
        for tag in orphans {
            if let Err(e) = bq.requeue(tag) {
                tracing::warn!(%vhost, queue = %name, error = %e, "requeue of a delivery nobody holds failed");
            }
        }
    }

    /// Makes this node's outstanding deliveries of queue `name` void: its
    /// store was replaced by one whose delivery tags start again (a fresh
    /// mirror, a log opened again after a disk failure), so a client's later
    /// ack, reject or channel close must not settle another message under
    /// the same tag. Its consumers' unacked counts start again.
    pub(super) fn void_deliveries(&mut self, vhost: &str, name: &str) {
        for c in self.conns.values_mut().filter(|c| c.vhost == vhost) {
            for ch in c.channels.values_mut() {
                for u in ch.unacked.values_mut() {
                    if u.remote.is_none() && &*u.queue == name {
                        u.remote = Some(Elsewhere::Nowhere);
                    }
                }
            }
        }
        if let Some(q) = self.queue_mut(vhost, name) {
            for c in &mut q.consumers {
                c.unacked = 0;
            }
        }
    }

    /// Feeds queue `name`'s replica what its ring, record or clock said, and
    /// does what follows (deliveries, confirms).
    pub fn mirror_input(&mut self, vhost: &str, name: &str, input: MirrorInput, now_ms: u64) {
        // What it deletes (an expired or auto-delete queue) is committed off
        // the lock (`commits.rs`).
        self.detached(|b| {
            b.replica_input(vhost, name, input, now_ms);
            b.wake_clients();
        });
    }

    /// [`mirror_input`](Self::mirror_input) for many replicas in one turn:
    /// each `(vhost, name, input)` in order, the clients woken once at the
    /// end.
    pub fn mirror_inputs(&mut self, inputs: Vec<(&str, &str, MirrorInput)>, now_ms: u64) {
        self.detached(|b| {
            for (vhost, name, input) in inputs {
                b.replica_input(vhost, name, input, now_ms);
            }
            b.wake_clients();
        });
    }

    fn replica_input(&mut self, vhost: &str, name: &str, input: MirrorInput, now_ms: u64) {
        self.now = now_ms;
        self.current = 0;
        let Some(m) = self.mirrored(vhost, name) else {
            return;
        };
        let r = &mut m.replica;
        match input {
            MirrorInput::Ring(events) => {
                for e in events {
                    r.handle_ring_event(e);
                }
            }
            MirrorInput::View(v) => r.handle_view(v),
            MirrorInput::Record(rec) => r.handle_record(rec),
            MirrorInput::RecordSettled(rec) => r.record_settled(rec),
            MirrorInput::Tick => r.tick(now_ms),
            MirrorInput::Stop => r.stop(now_ms),
            MirrorInput::Majority(m) => r.set_isolated(!m),
        }
        self.mirror_turn(vhost, name);
        self.after_queue_op(vhost, name);
    }

    /// What the shell must send for queue `name`'s replica (empty if none).
    pub fn take_mirror_io(&mut self, vhost: &str, name: &str) -> MirrorIo {
        let Some(m) = self.mirrored(vhost, name) else {
            return MirrorIo {
                stopped: true,
                ..MirrorIo::default()
            };
        };
        MirrorIo {
            broadcasts: std::mem::take(&mut m.outbox),
            sends: std::mem::take(&mut m.sends),
            proposals: std::mem::take(&mut m.proposals),
            stopped: m.replica.role() == Role::Stopped,
            storage_failed: m.replica.storage_failed(),
        }
    }

    /// A fingerprint of the messages this node's copy of queue `name`
    /// holds (see `BackingQueue::digest`): equal on every replica that
    /// holds the same messages in the same order. `None` where this node
    /// holds no copy (the queue is served elsewhere, or its mirror here is
    /// not synchronised).
    #[must_use]
    pub fn queue_digest(&self, vhost: &str, name: &str) -> Option<u64> {
        let q = self.vhosts.get(vhost)?.queues.get(name)?;
        if q.remote.is_some() && matches!(q.store, Store::Local(_)) {
            return None;
        }
        q.store.digest()
    }

    /// Who holds queue `name`'s deliveries unacknowledged on this node, and
    /// how many each: client channels (`connection N channel C`) and
    /// forwarding links (`link from NODE`, deliveries to that node's
    /// consumers). What the queue counts unacknowledged beyond these is held
    /// by nobody here (a replica's, or a leak).
    #[must_use]
    pub fn unacked_holders(&self, vhost: &str, name: &str) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = self
            .conns
            .iter()
            .filter(|(_, c)| c.vhost == vhost)
            .flat_map(|(id, c)| {
                c.channels.iter().filter_map(move |(n, ch)| {
                    let held = ch
                        .unacked
                        .values()
                        .filter(|u| u.remote.is_none() && &*u.queue == name)
                        .count() as u64;
                    let who = match &c.link {
                        Some(l) => format!("link from {}", l.origin()),
                        None => format!("connection {id} channel {n}"),
                    };
                    (held > 0).then_some((who, held))
                })
            })
            .collect();
        out.sort();
        out
    }

    /// The id of this broker's queue `name`, if there is one: each
    /// declaration its own, so that a queue deleted and declared again is
    /// told apart from its predecessor ([`ReplicaStart::queue`]).
    #[must_use]
    pub fn queue_uid(&self, vhost: &str, name: &str) -> Option<u64> {
        Some(self.vhosts.get(vhost)?.queues.get(name)?.uid)
    }

    /// Queue `name`'s replica status, if it is mirrored here.
    #[must_use]
    pub fn replica_status(&self, vhost: &str, name: &str) -> Option<Status> {
        self.vhosts
            .get(vhost)
            .and_then(|v| v.queues.get(name))
            .and_then(|q| q.store.mirror_status())
    }

    /// Whether queue `name`'s replica is a mirror whose claim to be master
    /// may still be on its way ([`Replica::promoting`]).
    #[must_use]
    pub fn replica_promoting(&self, vhost: &str, name: &str) -> bool {
        matches!(
            self.vhosts.get(vhost).and_then(|v| v.queues.get(name)).map(|q| &q.store),
            Some(Store::Replica(m)) if m.replica.promoting()
        )
    }

    /// Whether queue `name`'s replica has no other live member in its ring.
    #[must_use]
    pub fn replica_alone(&self, vhost: &str, name: &str) -> bool {
        match self
            .vhosts
            .get(vhost)
            .and_then(|v| v.queues.get(name))
            .map(|q| &q.store)
        {
            Some(Store::Replica(m)) => m.replica.alone(),
            _ => true,
        }
    }

    /// Where durable queue `name` keeps its messages on disk.
    #[must_use]
    pub fn queue_dir(&self, vhost: &str, name: &str) -> Option<std::path::PathBuf> {
        self.vhosts.get(vhost)?.queues.get(name)?.dir.clone()
    }

    /// Where non-durable queue `name` pages bodies out past its budget.
    #[must_use]
    pub fn spill_dir(&self, vhost: &str, name: &str) -> Option<std::path::PathBuf> {
        self.vhosts.get(vhost)?.queues.get(name)?.spill_dir.clone()
    }

    /// The store settings of queue `name` (its mode: how many body bytes
    /// it keeps in memory), for a replica's fresh store.
    #[must_use]
    pub fn store_config(&self, vhost: &str, name: &str) -> warren_backing_queue::StoreConfig {
        let lazy = self
            .vhosts
            .get(vhost)
            .and_then(|v| v.queues.get(name))
            .is_some_and(|q| q.lazy);
        super::args::store_config(lazy)
    }

    /// Where this broker's durable queues keep their logs
    /// ([`BrokerConfig::storage`](crate::BrokerConfig::storage)).
    #[must_use]
    pub fn storage(&self) -> Arc<dyn warren_backing_queue::Storage> {
        self.cfg.storage.clone()
    }

    /// The node's journal of group commits, if it has one: a queue's
    /// directory is removed through it ([`warren_backing_queue::remove_log_dir`]).
    #[must_use]
    pub fn journal(&self) -> Option<Arc<warren_backing_queue::Journal>> {
        self.journal.clone()
    }

    /// Queue `name`'s ring, if it is mirrored here.
    #[must_use]
    pub fn replica_ring(&self, vhost: &str, name: &str) -> Option<String> {
        match &self.vhosts.get(vhost)?.queues.get(name)?.store {
            Store::Replica(m) => Some(m.ring.clone()),
            Store::Local(_) => None,
        }
    }

    /// Starts a sync of queue `name`'s unsynchronised mirrors (master only).
    pub fn sync_queue(&mut self, vhost: &str, name: &str) -> Result<(), String> {
        let m = self
            .mirrored(vhost, name)
            .ok_or_else(|| format!("queue '{name}' in vhost '{vhost}' is not mirrored here"))?;
        m.replica.sync().map_err(err_text)?;
        self.mirror_turn(vhost, name);
        Ok(())
    }

    /// Cancels a running sync of queue `name` (master only).
    pub fn cancel_sync_queue(&mut self, vhost: &str, name: &str) -> Result<(), String> {
        let m = self
            .mirrored(vhost, name)
            .ok_or_else(|| format!("queue '{name}' in vhost '{vhost}' is not mirrored here"))?;
        m.replica.cancel_sync().map_err(err_text)?;
        self.mirror_turn(vhost, name);
        Ok(())
    }

    /// Applies new mirroring settings to queue `name`'s replica.
    pub fn set_replica_settings(&mut self, vhost: &str, name: &str, mut settings: Settings) {
        settings.report_dropped = true;
        let Some(q) = self.vhosts.get(vhost).and_then(|v| v.queues.get(name)) else {
            return;
        };
        settings.max_priority = q.max_priority;
        if let Some(m) = self.mirrored(vhost, name) {
            m.replica.set_settings(settings);
            self.mirror_turn(vhost, name);
        }
    }

    fn mirrored(&mut self, vhost: &str, name: &str) -> Option<&mut Mirrored> {
        match &mut self.vhosts.get_mut(vhost)?.queues.get_mut(name)?.store {
            Store::Replica(m) => Some(m),
            Store::Local(_) => None,
        }
    }

    /// Flushes queue `name`'s replica and handles its outputs.
    pub(crate) fn mirror_turn(&mut self, vhost: &str, name: &str) {
        let Some(q) = self
            .vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(name))
        else {
            return;
        };
        let qname = q.name.clone();
        let Store::Replica(m) = &mut q.store else {
            return;
        };
        let mut wake_shell = false;
        let mut handed_out = false;
        // The connections whose gets were answered (they go on reading).
        let mut answered = Vec::new();
        let mut want_sync = m.replica.awaits_storage_sync();
        let mut promoted = false;
        // Outputs until there are none: handing out fetches makes room in
        // consumers' windows, the new fetches make broadcasts.
        loop {
            let Store::Replica(m) = &mut q.store else {
                return;
            };
            m.replica.flush();
            if m.replica.role() == Role::Master {
                m.master = true;
            }
            let outputs: Vec<Output> = m.replica.drain_outputs().collect();
            if outputs.is_empty() {
                break;
            }
            let mut handed_now = false;
            for o in outputs {
                match o {
                    Output::Broadcast(b) => {
                        m.outbox.push(b);
                        wake_shell = true;
                    }
                    Output::Send { to, payload } => {
                        m.sends.push((to, payload));
                        wake_shell = true;
                    }
                    Output::ProposeRecord {
                        expected_version,
                        view,
                    } => {
                        m.proposals.push((expected_version, view));
                        wake_shell = true;
                    }
                    Output::Confirmed(ids) => {
                        for id in ids {
                            for (conn, ch, cseq) in m.owed(id) {
                                confirm_one(&mut self.conns, conn, ch, cseq);
                            }
                        }
                    }
                    Output::Nacked(ids) => {
                        for id in ids {
                            for (conn, ch, cseq) in m.owed(id) {
                                nack_one(&mut self.conns, conn, ch, cseq);
                            }
                        }
                    }
                    Output::Fetched { token, delivery } => {
                        let Some(f) = m.fetches.remove(&token) else {
                            continue;
                        };
                        handed_now = true;
                        answered.extend(f.getter());
                        if let Some(d) = &delivery {
                            q.delivered_at_ms = self.now;
                            q.counters.delivered += 1;
                            q.counters.redelivered += u64::from(d.redelivered);
                        }
                        let remaining = m.replica.stats().map_or(0, |s| s.ready);
                        let res = match hand_out(
                            &mut self.conns,
                            q.consumers.as_mut_slice(),
                            &qname,
                            f,
                            delivery,
                            remaining,
                            self.now,
                        ) {
                            After::Nothing => Ok(()),
                            After::Ack(tag) => m.replica.ack(tag),
                            After::Requeue(tag) => m.replica.requeue(tag),
                        };
                        if let Err(e) = res {
                            tracing::error!(%vhost, queue = %qname, error = %e, "settling a fetched message failed");
                        }
                    }
                    Output::FetchFailed { token } => {
                        if let Some(f) = m.fetches.remove(&token) {
                            handed_now = true;
                            answered.extend(f.getter());
                            hand_out(
                                &mut self.conns,
                                q.consumers.as_mut_slice(),
                                &qname,
                                f,
                                None,
                                0,
                                self.now,
                            );
                        }
                    }
                    Output::Promoted { epoch, held } => {
                        tracing::info!(%vhost, queue = %qname, view = epoch, publishers = held.publishers(), "promoted to queue master");
                        want_sync = true;
                        promoted = true;
                        // x-expires counts from the takeover, once other
                        // nodes' consumers had time to find it.
                        q.last_used_ms = self.now + super::TAKEOVER_GRACE_MS;
                    }
                    Output::Deposed { epoch } => {
                        tracing::warn!(%vhost, queue = %qname, view = epoch, "queue master deposed");
                        wake_shell = true;
                    }
                    Output::SyncComplete => {
                        tracing::info!(%vhost, queue = %qname, "mirror synchronised");
                    }
                    Output::Dropped(d) => m.dropped.extend(d),
                }
            }
            // Handed-out fetches left room in the consumers' windows: fetch more.
            if handed_now {
                handed_out = true;
                super::drive_replica(q, &mut self.conns, self.now);
            }
        }
        let Store::Replica(m) = &mut q.store else {
            return;
        };
        if m.replica.role() == Role::Stopped {
            wake_shell = true;
        }
        if wake_shell {
            (m.waker)();
        }
        let backlog = m.replica.backlog();
        let backlog_bytes = m.replica.backlog_bytes();
        if want_sync || m.replica.awaits_storage_sync() {
            self.want_sync();
        } else if m.replica.needs_storage_sync() {
            // Acks and delivery marks: with the next commit, or soon.
            self.want_lazy_sync();
        }
        let key = (vhost.to_owned(), qname.clone());
        if backlog > BACKLOG_HIGH || backlog_bytes > BACKLOG_HIGH_BYTES {
            self.backlogged.insert(key);
        } else if backlog < BACKLOG_LOW
            && backlog_bytes < BACKLOG_LOW_BYTES
            && self.backlogged.remove(&key)
        {
            self.wake_clients();
        }
        // Deliveries went to clients or down links: wake whoever carries them.
        if handed_out {
            self.wake_clients();
        }
        for conn in answered {
            self.reply_answered(conn);
        }
        // What waited for a master meanwhile (publishes, declares, gets).
        if promoted {
            self.unpark(vhost, &qname);
        }
    }

    /// Publishes into a replica (master), under the identity `sent` gives
    /// it if any (a replica holds each identity once); returns whether a
    /// confirm is owed.
    pub(super) fn replica_publish(
        &mut self,
        vhost: &str,
        name: &str,
        msg: warren_backing_queue::NewMessage,
        confirm: Option<(ConnId, ChannelId, u64)>,
        sent: Option<super::state::Sent>,
    ) -> Result<bool, warren_mirror::MirrorError> {
        let now = self.now;
        let id = match sent {
            Some(s) => s.id(),
            None => {
                let seq = self.next_publish;
                self.next_publish += 1;
                PublishId {
                    publisher: self.publisher_id,
                    seq,
                }
            }
        };
        let Some(m) = self.mirrored(vhost, name) else {
            return Ok(false);
        };
        if sent.is_some_and(super::state::Sent::again) {
            m.replica.publish_again(now, id, msg)?;
        } else {
            m.replica.publish(now, id, msg)?;
        }
        let owed = confirm.is_some();
        if let Some(c) = confirm
            && let Some(first) = m.publishes.insert(id, c)
        {
            m.also.entry(id).or_default().push(first);
        }
        Ok(owed)
    }
}

impl Mirrored {
    /// Starts a fetch for a consumer or a `basic.get`; `false` if the replica
    /// cannot serve (it is not the master).
    pub(crate) fn fetch(&mut self, now_ms: u64, f: FetchForArgs) -> bool {
        match self.replica.fetch(now_ms) {
            Ok(token) => {
                self.fetches.insert(token, f.0);
                true
            }
            Err(_) => false,
        }
    }

    /// The confirms still owed for publishes into this replica.
    pub(crate) fn owed_confirms(&self) -> impl Iterator<Item = (ConnId, ChannelId, u64)> + '_ {
        self.publishes
            .values()
            .chain(self.also.values().flatten())
            .copied()
    }

    /// Takes the confirms publish `id` owes (it was confirmed or nacked).
    fn owed(&mut self, id: PublishId) -> impl Iterator<Item = (ConnId, ChannelId, u64)> + use<> {
        let first = self.publishes.remove(&id);
        let also = if self.also.is_empty() {
            Vec::new()
        } else {
            self.also.remove(&id).unwrap_or_default()
        };
        first.into_iter().chain(also)
    }

    /// Wakes the shell task (the queue went away: it leaves the ring).
    pub(crate) fn wake_shell(&self) {
        (self.waker)();
    }

    /// The fetches still in flight, which never finish (the queue is
    /// deleted): each `basic.get` answered empty (their connections are
    /// returned), each consumer's given back to its channel's global
    /// prefetch.
    pub(super) fn answer_gets_empty(
        &mut self,
        conns: &mut IdMap<ConnId, super::Conn>,
    ) -> Vec<ConnId> {
        let mut answered = Vec::new();
        for (_, f) in self.fetches.drain() {
            match f {
                FetchFor::Get {
                    conn, channel, req, ..
                } => {
                    if let Some(c) = conns.get_mut(&conn) {
                        c.answering_get(req);
                        c.send_get_empty(channel);
                    }
                    answered.push(conn);
                }
                // Its channel's global prefetch no longer counts it.
                FetchFor::Consumer {
                    conn,
                    channel,
                    no_ack: false,
                    ..
                } => {
                    if let Some(ch) = conns
                        .get_mut(&conn)
                        .and_then(|c| c.channels.get_mut(&channel))
                    {
                        ch.fetching = ch.fetching.saturating_sub(1);
                    }
                }
                FetchFor::Consumer { .. } => {}
            }
        }
        answered
    }
}

impl FetchFor {
    /// The connection of a `basic.get` (whose input waits for the answer).
    fn getter(&self) -> Option<ConnId> {
        match self {
            FetchFor::Get { conn, .. } => Some(*conn),
            FetchFor::Consumer { .. } => None,
        }
    }
}

/// Who a replica fetch is for (opaque outside this module).
#[derive(Debug, Clone)]
pub(crate) struct FetchForArgs(FetchFor);

impl FetchForArgs {
    pub(crate) fn consumer(conn: ConnId, channel: ChannelId, tag: Arc<str>, no_ack: bool) -> Self {
        Self(FetchFor::Consumer {
            conn,
            channel,
            tag,
            no_ack,
        })
    }

    /// For a `basic.get`; `req` is the origin's request when the get came
    /// down a forwarding link.
    pub(crate) fn get(conn: ConnId, channel: ChannelId, no_ack: bool, req: Option<u64>) -> Self {
        Self(FetchFor::Get {
            conn,
            channel,
            no_ack,
            req,
        })
    }
}

/// What to do with a fetched message after [`hand_out`].
enum After {
    /// Delivered and pending ack (or nothing fetched).
    Nothing,
    /// Delivered to a no-ack consumer or get: ack it in the queue.
    Ack(DeliveryTag),
    /// Its consumer is gone: back to the queue.
    Requeue(DeliveryTag),
}

/// Hands a fetched message to whoever it was fetched for.
fn hand_out(
    conns: &mut IdMap<ConnId, super::Conn>,
    consumers: &mut [super::Consumer],
    queue: &Arc<str>,
    f: FetchFor,
    delivery: Option<Delivery>,
    remaining: u64,
    now: u64,
) -> After {
    match f {
        FetchFor::Consumer {
            conn,
            channel,
            tag,
            no_ack,
        } => {
            if !no_ack
                && let Some(ch) = conns
                    .get_mut(&conn)
                    .and_then(|c| c.channels.get_mut(&channel))
            {
                ch.fetching = ch.fetching.saturating_sub(1);
            }
            let cons = consumers
                .iter_mut()
                .find(|c| c.conn == conn && c.channel == channel && c.tag == tag);
            let Some(cons) = cons else {
                return delivery.map_or(After::Nothing, |d| After::Requeue(d.tag));
            };
            cons.reserved = cons.reserved.saturating_sub(1);
            let (Some(d), Some(c)) = (delivery, conns.get_mut(&conn)) else {
                if !no_ack {
                    cons.unacked = cons.unacked.saturating_sub(1);
                }
                return After::Nothing;
            };
            let Some(ch) = c.channels.get_mut(&channel) else {
                return After::Requeue(d.tag);
            };
            ch.next_tag += 1;
            let dtag = ch.next_tag;
            if !no_ack {
                ch.unacked.insert(
                    dtag,
                    Unacked {
                        queue: queue.clone(),
                        bq_tag: d.tag,
                        consumer: Some(tag.clone()),
                        seq: cons.pace.sent(),
                        remote: None,
                        delivered_at_ms: now,
                    },
                );
            }
            let m = decode_meta(&d.props);
            c.send_message(
                channel,
                &ContentMethod::Deliver {
                    consumer_tag: &tag,
                    delivery_tag: dtag,
                    redelivered: d.redelivered,
                    exchange: m.exchange,
                    routing_key: m.routing_key,
                },
                &m.properties,
                &d.props,
                &d.body,
            );
            c.out_pending += d.body.len() + 64;
            if no_ack {
                After::Ack(d.tag)
            } else {
                After::Nothing
            }
        }
        FetchFor::Get {
            conn,
            channel,
            no_ack,
            req,
        } => {
            let Some(c) = conns
                .get_mut(&conn)
                .filter(|c| c.channels.contains_key(&channel))
            else {
                return delivery.map_or(After::Nothing, |d| After::Requeue(d.tag));
            };
            c.answering_get(req);
            let Some(ch) = c.channels.get_mut(&channel) else {
                return delivery.map_or(After::Nothing, |d| After::Requeue(d.tag));
            };
            let Some(d) = delivery else {
                c.send_get_empty(channel);
                return After::Nothing;
            };
            ch.next_tag += 1;
            let dtag = ch.next_tag;
            if !no_ack {
                ch.unacked.insert(
                    dtag,
                    Unacked {
                        queue: queue.clone(),
                        bq_tag: d.tag,
                        consumer: None,
                        seq: 0,
                        remote: None,
                        delivered_at_ms: now,
                    },
                );
            }
            let m = decode_meta(&d.props);
            c.send_message(
                channel,
                &ContentMethod::GetOk {
                    delivery_tag: dtag,
                    redelivered: d.redelivered,
                    exchange: m.exchange,
                    routing_key: m.routing_key,
                    message_count: u32::try_from(remaining).unwrap_or(u32::MAX),
                },
                &m.properties,
                &d.props,
                &d.body,
            );
            if no_ack {
                After::Ack(d.tag)
            } else {
                After::Nothing
            }
        }
    }
}

/// Sends `basic.nack` for publish `cseq` of channel `ch` (a transaction's
/// publish fails its commit: 406 once the others are settled, as
/// RabbitMQ's "partial tx completion").
pub(super) fn nack_one(
    conns: &mut IdMap<ConnId, super::Conn>,
    conn: ConnId,
    ch: ChannelId,
    cseq: u64,
) {
    if cseq == super::TX_COMMIT {
        tracing::warn!(
            channel = ch,
            "a transactional publish was refused (its mirrored queue's master went): the commit fails"
        );
        if let Some(chan) = conns.get_mut(&conn).and_then(|c| c.channels.get_mut(&ch)) {
            chan.tx_failed = true;
        }
        confirm_one(conns, conn, ch, cseq);
        return;
    }
    let Some(c) = conns.get_mut(&conn) else {
        return;
    };
    let Some(chan) = c.channels.get_mut(&ch) else {
        return;
    };
    if chan.confirm_pending.remove(&cseq).is_some() {
        if c.link_confirmed(cseq, false) {
            return;
        }
        if let Some(chan) = c.channels.get_mut(&ch) {
            chan.confirm_nacked.insert(cseq);
        }
    }
    if !c.confirm_dirty.contains(&ch) {
        c.confirm_dirty.push(ch);
    }
}

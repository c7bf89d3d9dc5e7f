//! [`BackingQueue`]: the bookkeeping core plus, for durable queues, the
//! segment log.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use crate::core::{Entry, QueueCore, StoreRef};
use crate::error::{QueueError, StoreError};
use crate::log::{Hook, RecoveryReport, SegmentLog, StoreConfig, SyncJob, UnsyncedHook};
use crate::message::{
    Delivery, DeliveryTag, Dropped, Limits, NewMessage, Op, Published, SeqId, Snapshot,
    SnapshotMessage,
};
use crate::record::PublishMeta;
use crate::storage::{FsStorage, Storage};

/// Options of a queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueConfig {
    /// TTL and length limits.
    pub limits: Limits,
    /// Record every applied op, for [`BackingQueue::take_ops`] (the master of
    /// a mirrored queue turns on this).
    pub record_ops: bool,
    /// Keep dropped messages for [`BackingQueue::take_dropped`] (dead-lettering).
    pub report_dropped: bool,
    /// `x-max-priority`: a priority queue with priorities `0 ..= max`
    /// (`None`: no priorities, one FIFO).
    pub max_priority: Option<u8>,
}

/// Message counts and sizes of a queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Messages ready for delivery.
    pub ready: u64,
    /// Messages delivered and pending ack.
    pub unacked: u64,
    /// Body bytes of ready messages.
    pub ready_bytes: u64,
    /// Body bytes of unacked messages.
    pub unacked_bytes: u64,
    /// Bytes of the durable log's files (0 for a non-durable queue).
    pub disk_bytes: u64,
}

/// What applying an [`Op`] produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpOutcome {
    /// A publish.
    Published(Published),
    /// A fetch: the message, or `None` if the queue was empty.
    Fetched(Option<Delivery>),
    /// A purge: how many messages it removed.
    Purged(u64),
    /// Any other op.
    Done,
}

/// One queue's messages: ready in order (highest priority first in a
/// priority queue), pending ack, and (durable queue)
/// persistent ones in a segment log.
///
/// All methods are synchronous and deterministic given their inputs; only
/// durable queues touch files, and only [`SyncJob::run`] blocks on fsync.
///
/// Confirms: a publish whose [`Published::needs_sync`] is `false` may be
/// confirmed at once. Otherwise it is confirmed when
/// [`synced_seq`](Self::synced_seq) reaches its seq, i.e. after the group
/// commit covering it ([`sync`](Self::sync), or
/// [`prepare_sync`](Self::prepare_sync) / [`SyncJob::run`] /
/// [`complete_sync`](Self::complete_sync)); [`drain_confirmed`](Self::drain_confirmed)
/// lists those seqs.
///
/// Dropping a queue does not sync: call [`sync`](Self::sync) first for a
/// clean shutdown. Drain [`drain_confirmed`](Self::drain_confirmed) (and
/// [`take_ops`](Self::take_ops), [`take_dropped`](Self::take_dropped) when
/// turned on) regularly: they accumulate until drained.
#[derive(Debug)]
pub struct BackingQueue {
    core: QueueCore,
    log: Option<SegmentLog>,
    /// A non-durable queue's log, opened (empty) only once its bodies pass
    /// `resident_bytes_max` ([`spilling`](Self::spilling)).
    spill: Option<Spill>,
    resident_bytes_max: u64,
    unconfirmed: VecDeque<SeqId>,
    ops: Option<Vec<Op>>,
    report_dropped: bool,
    /// Messages of a snapshot being installed ([`BackingQueue::install_part`]).
    installing: Option<Staged>,
}

/// The parts of a snapshot installed so far, held until
/// [`BackingQueue::finish_install`].
#[derive(Debug, Default)]
struct Staged {
    ready: Vec<Entry>,
    unacked: Vec<(DeliveryTag, Entry)>,
    /// Body bytes held in memory.
    resident: u64,
}

/// A queue's state at one point, for a mirror's synchronisation, whose
/// paged-out bodies are read back one batch at a time
/// ([`BackingQueue::snapshot_lazy`]).
#[derive(Debug)]
pub struct LazySnapshot {
    /// The next sequence number the queue gives.
    pub next_seq: SeqId,
    /// The next delivery tag the queue gives.
    pub next_tag: DeliveryTag,
    /// Its limits.
    pub limits: Limits,
    rest: VecDeque<LazyMessage>,
}

impl LazySnapshot {
    /// Messages not yet taken.
    #[must_use]
    pub fn len(&self) -> usize {
        self.rest.len()
    }

    /// Whether every message has been taken.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.rest.is_empty()
    }
}

/// One message of a [`LazySnapshot`]: its body, or where the log has it.
#[derive(Debug)]
struct LazyMessage {
    msg: SnapshotMessage,
    paged: Option<StoreRef>,
    /// Props and body bytes.
    bytes: usize,
    /// Props bytes (of `bytes`).
    props_len: usize,
}

/// Props ++ body as one buffer; without props, the body itself (no copy, and
/// no clone: cloning a `Bytes` made from a `Vec` allocates).
fn join(props: &Bytes, body: Bytes) -> Bytes {
    if props.is_empty() {
        return body;
    }
    let mut b = BytesMut::with_capacity(props.len() + body.len());
    b.extend_from_slice(props);
    b.extend_from_slice(&body);
    b.freeze()
}

/// Where a non-durable queue's bodies go past its memory budget.
#[derive(Debug)]
struct Spill {
    storage: Arc<dyn Storage>,
    dir: PathBuf,
    store: StoreConfig,
    /// For the log once it is opened ([`BackingQueue::on_unsynced`]).
    hook: Option<Hook>,
}

impl BackingQueue {
    /// A non-durable queue: everything in memory, nothing survives a restart.
    pub fn in_memory(cfg: QueueConfig) -> Self {
        Self {
            core: QueueCore::new(cfg.limits, cfg.max_priority),
            log: None,
            spill: None,
            resident_bytes_max: u64::MAX,
            unconfirmed: VecDeque::new(),
            ops: cfg.record_ops.then(Vec::new),
            report_dropped: cfg.report_dropped,
            installing: None,
        }
    }

    /// A durable queue whose log lives in `dir` (created if missing). Replays
    /// the log: the persistent messages that were not removed come back ready,
    /// in order, redelivered if they had been delivered.
    pub fn open(
        dir: &Path,
        cfg: QueueConfig,
        store: StoreConfig,
    ) -> Result<(Self, RecoveryReport), StoreError> {
        Self::open_in(FsStorage::shared(), dir, cfg, store)
    }

    /// [`open`](Self::open) on another [`Storage`], such as [`MemStorage`](crate::MemStorage).
    pub fn open_in(
        storage: Arc<dyn Storage>,
        dir: &Path,
        cfg: QueueConfig,
        store: StoreConfig,
    ) -> Result<(Self, RecoveryReport), StoreError> {
        Self::open_log(storage, dir, cfg, store, false)
    }

    /// [`open_in`](Self::open_in) again after this process's copy of the
    /// queue failed (a failed sync poisoned its log, [`StoreError::Poisoned`]):
    /// the delivery marks it held are lost, so every message recovered comes
    /// back marked delivered (`redelivered`), as after a machine restart.
    pub fn reopen_in(
        storage: Arc<dyn Storage>,
        dir: &Path,
        cfg: QueueConfig,
        store: StoreConfig,
    ) -> Result<(Self, RecoveryReport), StoreError> {
        Self::open_log(storage, dir, cfg, store, true)
    }

    fn open_log(
        storage: Arc<dyn Storage>,
        dir: &Path,
        cfg: QueueConfig,
        store: StoreConfig,
        marks_lost: bool,
    ) -> Result<(Self, RecoveryReport), StoreError> {
        let opened = SegmentLog::open(storage, dir, store, marks_lost)?;
        let mut q = Self::in_memory(cfg);
        q.core.restore(opened.messages, opened.next_seq);
        q.log = Some(opened.log);
        q.resident_bytes_max = store.resident_bytes_max;
        Ok((q, opened.report))
    }

    /// A non-durable queue that keeps its messages in memory up to
    /// `store.resident_bytes_max` body bytes, and beyond pages the bodies of
    /// new messages out to a log in `dir` on `storage`, created (emptied
    /// first) only then. Publish its messages as transient: nothing of it is
    /// meant to survive a restart, and the log is never read back at one.
    pub fn spilling(
        storage: Arc<dyn Storage>,
        dir: &Path,
        cfg: QueueConfig,
        store: StoreConfig,
    ) -> Self {
        let mut q = Self::in_memory(cfg);
        q.resident_bytes_max = store.resident_bytes_max;
        q.spill = Some(Spill {
            storage,
            dir: dir.to_owned(),
            store,
            hook: None,
        });
        q
    }

    /// Opens a spilling queue's log, at its first body past the budget.
    fn open_spill(&mut self) -> Result<(), StoreError> {
        let Some(spill) = self.spill.take() else {
            return Ok(());
        };
        if let Err(e) = spill.storage.remove_dir_all(&spill.dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            return Err(StoreError::io(&spill.dir, e));
        }
        let mut log = SegmentLog::open(spill.storage, &spill.dir, spill.store, false)?.log;
        if let Some(hook) = spill.hook {
            log.on_unsynced(hook.0);
        }
        self.log = Some(log);
        Ok(())
    }

    /// Logs an op for mirrors: called once the op has changed the core (ops
    /// that fail before that, such as an unknown tag, are not logged).
    fn record(&mut self, op: impl FnOnce() -> Op) {
        if let Some(ops) = &mut self.ops {
            ops.push(op());
        }
    }

    /// Writes what the core removed to the log, and forgets dropped messages
    /// nobody asked for.
    fn settle(&mut self) -> Result<(), StoreError> {
        if self.report_dropped {
            // Paged-out messages that left are read back while their
            // records are still there: dead-lettering needs them whole.
            if let Some(log) = &mut self.log {
                for d in self.core.dropped_mut() {
                    if d.data.is_none() && d.store.is_some() {
                        d.data = log.read(d.store).ok();
                    }
                }
            }
        } else {
            let mut none = Vec::new();
            self.core.take_dropped(&mut none);
        }
        let removed = self.core.removed_mut();
        if removed.is_empty() {
            return Ok(());
        }
        let res = match &mut self.log {
            Some(log) => log.mark_removed(removed),
            None => Ok(()),
        };
        removed.clear();
        res
    }

    /// Publishes a message at time `now_ms`.
    pub fn publish(&mut self, now_ms: u64, msg: NewMessage) -> Result<Published, QueueError> {
        let op_msg = self.ops.is_some().then(|| msg.clone());
        let expiry = self.core.expiry_for(now_ms, &msg);
        let seq = self.core.next_seq();
        let priority = self.core.priority_for(msg.priority);
        let mut store = StoreRef::NONE;
        let held = self.core.ready_bytes() + self.core.unacked_bytes();
        let resident = held.saturating_add(msg.body.len() as u64) <= self.resident_bytes_max;
        if !resident && self.log.is_none() {
            self.open_spill()?;
        }
        if let Some(log) = &mut self.log
            && (msg.persistent || !resident)
        {
            // Persistent messages for durability; transient ones only to page
            // their body out (recovery ignores those).
            let meta = PublishMeta {
                seq,
                id: msg.id,
                expiry_ms: expiry,
                delivered: false,
                transient: !msg.persistent,
                priority,
            };
            store = log.append_publish(meta, &msg.props, &msg.body)?;
            if msg.persistent {
                self.unconfirmed.push_back(seq);
            }
        }
        let msg_persistent = msg.persistent;
        let mut entry = Entry::new_message(&msg, expiry, store);
        entry.priority = priority;
        if resident {
            entry.data = Some(join(&msg.props, msg.body));
        }
        let seq = self.core.publish(entry);
        if let Some(msg) = op_msg {
            self.record(|| Op::Publish { now_ms, msg });
        }
        self.settle()?;
        Ok(Published {
            seq,
            needs_sync: store.is_some() && msg_persistent,
        })
    }

    /// Fetches the next ready message at time `now_ms` (dropping expired ones
    /// at the head); it becomes pending ack.
    pub fn fetch(&mut self, now_ms: u64) -> Result<Option<Delivery>, QueueError> {
        self.record(|| Op::Fetch { now_ms });
        let remaining = self.core.ready_len().saturating_sub(1);
        let Some((tag, redelivered, e)) = self.core.fetch(now_ms) else {
            self.settle()?;
            return Ok(None);
        };
        let (seq, id, persistent, store, data, props_len) = (
            e.seq,
            e.id,
            e.persistent(),
            e.store,
            e.data.clone(),
            e.props_len as usize,
        );
        let remaining = remaining.min(self.core.ready_len());
        self.settle()?;
        let data = match (data, &mut self.log) {
            (Some(d), _) => d,
            (None, Some(log)) => match log.read(store) {
                Ok(d) => d,
                Err(err) => {
                    self.core.requeue(tag);
                    return Err(err.into());
                }
            },
            (None, None) => Bytes::new(),
        };
        if !redelivered
            && persistent
            && store.is_some()
            && let Some(log) = &mut self.log
        {
            log.mark_delivered(seq)?;
        }
        let props_len = props_len.min(data.len());
        Ok(Some(Delivery {
            tag,
            seq,
            id,
            props: data.slice(..props_len),
            body: data.slice(props_len..),
            persistent,
            redelivered,
            remaining,
        }))
    }

    /// Acks a delivery: the message is gone.
    pub fn ack(&mut self, tag: DeliveryTag) -> Result<(), QueueError> {
        self.core
            .ack(tag)
            .ok_or(QueueError::UnknownDeliveryTag(tag))?;
        self.record(|| Op::Ack { tag });
        Ok(self.settle()?)
    }

    /// Rejects/nacks a delivery with requeue: the message goes back to its
    /// original position, marked redelivered.
    pub fn requeue(&mut self, tag: DeliveryTag) -> Result<(), QueueError> {
        if !self.core.requeue(tag) {
            return Err(QueueError::UnknownDeliveryTag(tag));
        }
        self.record(|| Op::Requeue { tag });
        Ok(self.settle()?)
    }

    /// Rejects/nacks a delivery without requeue: the message is dropped
    /// (reported as [`DropReason::Rejected`](crate::DropReason::Rejected)).
    pub fn discard(&mut self, tag: DeliveryTag) -> Result<(), QueueError> {
        self.core
            .discard(tag)
            .ok_or(QueueError::UnknownDeliveryTag(tag))?;
        self.record(|| Op::Discard { tag });
        Ok(self.settle()?)
    }

    /// Removes every ready message (unacked ones stay); returns how many.
    pub fn purge(&mut self) -> Result<u64, QueueError> {
        self.record(|| Op::Purge);
        let n = self.core.purge();
        self.settle()?;
        Ok(n)
    }

    /// Drops expired messages from the head of the queue (RabbitMQ expires
    /// only at the head). Call it at [`next_expiry_ms`](Self::next_expiry_ms).
    pub fn expire(&mut self, now_ms: u64) -> Result<(), QueueError> {
        self.record(|| Op::Expire { now_ms });
        self.core.expire(now_ms);
        Ok(self.settle()?)
    }

    /// Changes [`StoreConfig::resident_bytes_max`] (a policy changed the
    /// queue's mode). Messages held past the new budget go to disk now, as
    /// RabbitMQ's switch to lazy pages a queue out: their bodies leave
    /// memory (the oldest stay, up to the budget; a message not on disk yet
    /// is written to the log first). Later messages follow it as they come.
    pub fn set_resident_bytes_max(&mut self, bytes: u64) -> Result<(), QueueError> {
        let lowered = bytes < self.resident_bytes_max;
        self.resident_bytes_max = bytes;
        if !lowered {
            return Ok(());
        }
        let resident: u64 = self
            .core
            .entries_mut()
            .filter_map(|e| e.data.as_ref().map(|d| d.len() as u64))
            .sum();
        if resident <= bytes {
            return Ok(());
        }
        if self.log.is_none() {
            self.open_spill()?;
        }
        let Some(log) = self.log.as_mut() else {
            return Ok(());
        };
        let mut kept = 0u64;
        for e in self.core.entries_mut() {
            let Some(data) = &e.data else { continue };
            let len = data.len() as u64;
            if kept + len <= bytes {
                kept += len;
                continue;
            }
            if !e.store.is_some() {
                let props_len = (e.props_len as usize).min(data.len());
                let meta = PublishMeta {
                    seq: e.seq,
                    id: e.id,
                    expiry_ms: e.expiry_ms,
                    delivered: e.delivered(),
                    transient: true,
                    priority: e.priority,
                };
                e.store = log.append_publish(meta, &data[..props_len], &data.slice(props_len..))?;
            }
            e.data = None;
        }
        Ok(())
    }

    /// Changes the limits (a policy changed) and applies them at once.
    pub fn set_limits(&mut self, limits: Limits) -> Result<(), QueueError> {
        self.record(|| Op::SetLimits { limits });
        self.core.set_limits(limits);
        Ok(self.settle()?)
    }

    /// Applies one op, as a mirror does with its master's op log.
    pub fn apply(&mut self, op: Op) -> Result<OpOutcome, QueueError> {
        Ok(match op {
            Op::Publish { now_ms, msg } => OpOutcome::Published(self.publish(now_ms, msg)?),
            Op::Fetch { now_ms } => OpOutcome::Fetched(self.fetch(now_ms)?),
            Op::Ack { tag } => self.ack(tag).map(|()| OpOutcome::Done)?,
            Op::Requeue { tag } => self.requeue(tag).map(|()| OpOutcome::Done)?,
            Op::Discard { tag } => self.discard(tag).map(|()| OpOutcome::Done)?,
            Op::Purge => OpOutcome::Purged(self.purge()?),
            Op::Expire { now_ms } => self.expire(now_ms).map(|()| OpOutcome::Done)?,
            Op::SetLimits { limits } => self.set_limits(limits).map(|()| OpOutcome::Done)?,
        })
    }

    /// Starts or stops recording applied ops (see [`take_ops`](Self::take_ops)):
    /// a queue that becomes a mirrored queue's master starts recording.
    pub fn set_record_ops(&mut self, on: bool) {
        match (on, self.ops.is_some()) {
            (true, false) => self.ops = Some(Vec::new()),
            (false, true) => self.ops = None,
            _ => {}
        }
    }

    /// The ops applied since the last call (empty unless `record_ops`); ops
    /// refused with an error and no effect are left out.
    pub fn take_ops(&mut self) -> Vec<Op> {
        self.ops.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Moves the messages dropped since the last call (expired, over the
    /// limits, rejected) into `out` (only with `report_dropped`).
    pub fn take_dropped(&mut self, out: &mut Vec<Dropped>) {
        self.core.take_dropped(out);
    }

    /// When the head message expires, if it can: when to call [`expire`](Self::expire).
    pub fn next_expiry_ms(&self) -> Option<u64> {
        self.core.head_expiry_ms()
    }

    /// The current limits.
    pub fn limits(&self) -> Limits {
        self.core.limits()
    }

    /// Counts and sizes.
    pub fn stats(&self) -> Stats {
        Stats {
            ready: self.core.ready_len(),
            unacked: self.core.unacked_len(),
            ready_bytes: self.core.ready_bytes(),
            unacked_bytes: self.core.unacked_bytes(),
            disk_bytes: self.log.as_ref().map_or(0, SegmentLog::disk_bytes),
        }
    }

    /// The sequence number the next published message takes.
    #[must_use]
    pub fn next_seq(&self) -> SeqId {
        self.core.next_seq()
    }

    /// Sequence numbers of the ready messages, head first.
    pub fn ready_seqs(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.core.ready_seqs()
    }

    /// A fingerprint of what the queue holds: every message, ready ones in
    /// their order and pending ones by delivery tag, each by its seq, id,
    /// sizes, priority, expiry and flags (not its bytes, which may be paged
    /// out on one replica and not on another). Two replicas that applied
    /// the same operations have the same digest; any divergence (a message
    /// missing, extra, reordered or settled differently) changes it.
    pub fn digest(&self) -> u64 {
        // A word at a time (FxHash's step): stable across processes and
        // builds, unlike std's hasher, and cheap enough for a long queue.
        let mut h: u64 = 0;
        let mut mix = |v: u64| {
            h = (h.rotate_left(5) ^ v).wrapping_mul(0x517c_c1b7_2722_0a95);
        };
        for (tag, e) in self.core.held() {
            mix(tag.map_or(0, |t| t + 1));
            mix(e.seq);
            mix(e.id);
            mix(u64::from(e.props_len) << 32 | u64::from(e.body_len));
            mix(e.expiry_ms);
            mix(u64::from(e.priority) << 8
                | u64::from(e.persistent()) << 1
                | u64::from(e.delivered()));
        }
        h
    }

    /// The queue's whole state (bodies read back from the log when paged
    /// out), for a mirror's synchronisation. Holds every body in memory at
    /// once: a sync sends [`snapshot_lazy`](Self::snapshot_lazy) instead.
    pub fn snapshot(&mut self) -> Result<Snapshot, QueueError> {
        let mut lazy = self.snapshot_lazy();
        let messages = self.snapshot_batch(&mut lazy, usize::MAX, usize::MAX);
        self.end_snapshot();
        Ok(Snapshot {
            next_seq: lazy.next_seq,
            next_tag: lazy.next_tag,
            limits: lazy.limits,
            messages: messages?,
        })
    }

    /// The queue's state now, for a mirror's synchronisation, without its
    /// paged-out bodies: [`snapshot_batch`](Self::snapshot_batch) reads them
    /// back a batch at a time, so memory holds one batch rather than the
    /// queue. Until [`end_snapshot`](Self::end_snapshot) the log keeps every
    /// segment (what the queue removes meanwhile stays on disk).
    pub fn snapshot_lazy(&mut self) -> LazySnapshot {
        if let Some(log) = &mut self.log {
            log.pin(true);
        }
        let rest = self
            .core
            .held()
            .map(|(tag, e)| {
                let (props, body) = match &e.data {
                    Some(d) => {
                        let props_len = (e.props_len as usize).min(d.len());
                        (d.slice(..props_len), d.slice(props_len..))
                    }
                    None => (Bytes::new(), Bytes::new()),
                };
                let paged = e.data.is_none() && e.store.is_some();
                let bytes = e.props_len as usize + e.body_len as usize;
                let msg = SnapshotMessage {
                    seq: e.seq,
                    id: e.id,
                    props,
                    body,
                    persistent: e.persistent(),
                    expiry_ms: e.expiry_ms,
                    delivered: e.delivered(),
                    tag,
                    priority: e.priority,
                };
                LazyMessage {
                    msg,
                    paged: paged.then_some(e.store),
                    bytes,
                    props_len: e.props_len as usize,
                }
            })
            .collect();
        LazySnapshot {
            next_seq: self.core.next_seq(),
            next_tag: self.core.next_tag(),
            limits: self.core.limits(),
            rest,
        }
    }

    /// The next messages of `snap`: at most `max_msgs`, and no more once
    /// they carry `max_bytes` (at least one), paged-out bodies read back from
    /// the log.
    pub fn snapshot_batch(
        &mut self,
        snap: &mut LazySnapshot,
        max_msgs: usize,
        max_bytes: usize,
    ) -> Result<Vec<SnapshotMessage>, QueueError> {
        let mut bytes = 0usize;
        let take = snap
            .rest
            .iter()
            .take(max_msgs.max(1))
            .take_while(|m| {
                let fits = bytes < max_bytes;
                bytes = bytes.saturating_add(m.bytes);
                fits
            })
            .count()
            .max(1)
            .min(snap.rest.len());
        let mut out = Vec::with_capacity(take);
        for m in snap.rest.drain(..take) {
            let mut msg = m.msg;
            if let (Some(at), Some(log)) = (m.paged, &mut self.log) {
                let data = log.read(at)?;
                let props_len = m.props_len.min(data.len());
                msg.props = data.slice(..props_len);
                msg.body = data.slice(props_len..);
            }
            out.push(msg);
        }
        Ok(out)
    }

    /// Ends a [`snapshot_lazy`](Self::snapshot_lazy): the log retires and
    /// compacts again. Harmless without one.
    pub fn end_snapshot(&mut self) {
        if let Some(log) = &mut self.log {
            log.pin(false);
        }
    }

    /// Makes this queue, which must hold no message, a copy of the snapshot's
    /// queue: same messages, seqs, tags and limits, so that the source's later
    /// ops give the same results here. Persistent messages go to the log of a
    /// durable queue (durable after the next sync). Returns `false` (and
    /// changes nothing) if the queue holds messages.
    pub fn install_snapshot(&mut self, snap: Snapshot) -> Result<bool, QueueError> {
        if !self.install_part(snap.messages)? {
            return Ok(false);
        }
        self.finish_install(snap.next_seq, snap.next_tag, snap.limits)
    }

    /// Takes a part of a snapshot ([`snapshot_batch`](Self::snapshot_batch))
    /// into this queue, which must hold no message (`false`, and nothing
    /// changes, if it does): persistent messages are appended to the log of
    /// a durable queue, and bodies past the memory budget live only in the
    /// log, as [`publish`](Self::publish) keeps them. The queue holds them
    /// once [`finish_install`](Self::finish_install) is called.
    pub fn install_part(&mut self, msgs: Vec<SnapshotMessage>) -> Result<bool, QueueError> {
        if !self.core.is_empty() {
            return Ok(false);
        }
        let mut staged = self.installing.take().unwrap_or_default();
        let res = self.stage(&mut staged, msgs);
        self.installing = Some(staged);
        res.map(|()| true)
    }

    fn stage(&mut self, staged: &mut Staged, msgs: Vec<SnapshotMessage>) -> Result<(), QueueError> {
        for m in msgs {
            let priority = self.core.priority_for(m.priority);
            let len = (m.props.len() + m.body.len()) as u64;
            let resident = staged.resident.saturating_add(len) <= self.resident_bytes_max;
            if !resident && self.log.is_none() {
                self.open_spill()?;
            }
            let mut store = StoreRef::NONE;
            if let Some(log) = &mut self.log
                && (m.persistent || !resident)
            {
                let meta = PublishMeta {
                    seq: m.seq,
                    id: m.id,
                    expiry_ms: m.expiry_ms,
                    delivered: m.delivered,
                    transient: !m.persistent,
                    priority,
                };
                store = log.append_publish(meta, &m.props, &m.body)?;
                if m.persistent {
                    self.unconfirmed.push_back(m.seq);
                }
            }
            let mut e = Entry::from_snapshot(&m, store);
            e.priority = priority;
            if resident || !store.is_some() {
                staged.resident += len;
                e.data = Some(join(&m.props, m.body));
            }
            match m.tag {
                Some(t) => staged.unacked.push((t, e)),
                None => staged.ready.push(e),
            }
        }
        Ok(())
    }

    /// Ends an install begun with [`install_part`](Self::install_part): the
    /// queue now holds every part, with the source's counters and limits.
    /// `false` (nothing changes) if the queue holds messages.
    pub fn finish_install(
        &mut self,
        next_seq: SeqId,
        next_tag: DeliveryTag,
        limits: Limits,
    ) -> Result<bool, QueueError> {
        if !self.core.is_empty() {
            return Ok(false);
        }
        let Staged {
            mut ready,
            mut unacked,
            ..
        } = self.installing.take().unwrap_or_default();
        ready.sort_by_key(|e| e.seq);
        unacked.sort_by_key(|(_, e)| e.seq);
        self.unconfirmed.make_contiguous().sort_unstable();
        self.core
            .install(ready, unacked, next_seq, next_tag, limits);
        Ok(true)
    }

    /// Tags of the deliveries pending ack, in tag order.
    pub fn unacked_tags(&self) -> Vec<DeliveryTag> {
        self.core.held().filter_map(|(t, _)| t).collect()
    }

    /// Calls `hook` when the queue's log gets something to sync (at once
    /// if it has something now), then not again until
    /// [`arm_unsynced`](Self::arm_unsynced): an owner of many queues keeps
    /// the list of those to commit instead of asking each one
    /// [`needs_sync`](Self::needs_sync). A queue without a log calls once
    /// it has one (a spilling queue past its budget).
    pub fn on_unsynced(&mut self, hook: UnsyncedHook) {
        if let Some(log) = self.log.as_mut() {
            log.on_unsynced(hook);
        } else if let Some(spill) = self.spill.as_mut() {
            spill.hook = Some(Hook(hook));
        }
    }

    /// Calls the hook of [`on_unsynced`](Self::on_unsynced) if the log has
    /// something to sync and the hook was not called since it was armed:
    /// true only if a change failed to call it (a check for its owner).
    pub fn tell_unsynced(&mut self) -> bool {
        self.log.as_mut().is_some_and(SegmentLog::tell_unsynced)
    }

    /// Arms the hook of [`on_unsynced`](Self::on_unsynced) again, calling it
    /// at once if the log still has something to sync (a commit in flight,
    /// or one not prepared); returns whether it did.
    pub fn arm_unsynced(&mut self) -> bool {
        self.log.as_mut().is_some_and(SegmentLog::arm_unsynced)
    }

    /// Whether a group commit has anything to do.
    pub fn needs_sync(&self) -> bool {
        self.log.as_ref().is_some_and(SegmentLog::has_unsynced)
    }

    /// Whether a group commit is awaited: a publish was logged since the
    /// last one (its confirm waits for it). Acks and delivery marks alone
    /// may wait for a later commit: losing them in a crash only
    /// redelivers, as in RabbitMQ.
    pub fn awaits_sync(&self) -> bool {
        self.log
            .as_ref()
            .is_some_and(SegmentLog::has_unsynced_publishes)
    }

    /// Every persistent publish with seq ≤ this is durable (fsynced) and may
    /// be confirmed.
    pub fn synced_seq(&self) -> SeqId {
        self.log.as_ref().map_or(0, SegmentLog::synced_seq)
    }

    /// Moves into `out` the seqs of persistent publishes that became durable
    /// since the last call, in publish order: confirm these.
    pub fn drain_confirmed(&mut self, out: &mut Vec<SeqId>) {
        let synced = self.synced_seq();
        while let Some(&s) = self.unconfirmed.front() {
            if s > synced {
                break;
            }
            out.push(s);
            self.unconfirmed.pop_front();
        }
    }

    /// One group commit, inline: writes and fsyncs everything appended so far
    /// (one `fdatasync` for all of it). Returns [`synced_seq`](Self::synced_seq).
    pub fn sync(&mut self) -> Result<SeqId, QueueError> {
        if let Some(mut job) = self.prepare_sync()? {
            job.run()?;
            self.complete_sync(&job)?;
        }
        Ok(self.synced_seq())
    }

    /// Starts a group commit: writes out the appended records (compacting the
    /// log first if it is worth it) and returns the job to run, off the
    /// queue's thread if wanted, while more publishes are appended. `None`
    /// for a non-durable queue. Run jobs one at a time and complete them in
    /// order.
    pub fn prepare_sync(&mut self) -> Result<Option<SyncJob>, QueueError> {
        self.compact()?;
        match &mut self.log {
            Some(log) => Ok(Some(log.prepare_sync()?)),
            None => Ok(None),
        }
    }

    /// Finishes a group commit after [`SyncJob::run`]; returns the new
    /// [`synced_seq`](Self::synced_seq).
    pub fn complete_sync(&mut self, job: &SyncJob) -> Result<SeqId, QueueError> {
        match &mut self.log {
            Some(log) => Ok(log.complete_sync(job)?),
            None => Ok(0),
        }
    }

    /// Copies the live messages of the head segment forward and retires it,
    /// while the log holds much more than the live messages.
    fn compact(&mut self) -> Result<(), StoreError> {
        let Some(log) = &mut self.log else {
            return Ok(());
        };
        while let Some(head) = log.compaction_candidate() {
            for e in self.core.entries_mut() {
                if e.store.segment != head {
                    continue;
                }
                let data = match &e.data {
                    Some(d) => d.clone(),
                    None => log.read(e.store)?,
                };
                let props_len = (e.props_len as usize).min(data.len());
                let (props, body) = data.split_at(props_len);
                let meta = PublishMeta {
                    seq: e.seq,
                    id: e.id,
                    expiry_ms: e.expiry_ms,
                    delivered: e.delivered(),
                    transient: !e.persistent(),
                    priority: e.priority,
                };
                e.store = log.append_publish(meta, props, body)?;
            }
            log.retire_front();
        }
        Ok(())
    }
}

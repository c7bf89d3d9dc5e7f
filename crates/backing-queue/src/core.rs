//! The sans-IO bookkeeping of one queue: ready messages in delivery order
//! (sequence order, within each priority for a priority queue),
//! deliveries pending acknowledgement, limits and expiry. No files, no clock:
//! time comes in as `now_ms`, and the durable log is driven by
//! [`BackingQueue`](crate::BackingQueue), which reads the removals this core
//! records.

use std::collections::BTreeMap;

use bytes::Bytes;

use crate::message::{DeliveryTag, DropReason, Dropped, Limits, NewMessage, SeqId};
use crate::ready::Ready;
use crate::record::PublishMeta;

/// Where a message's record sits in the segment log. Opaque to the core.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StoreRef {
    pub(crate) segment: u32,
    pub(crate) offset: u32,
}

impl StoreRef {
    /// Not in the log (transient message, or non-durable queue).
    pub(crate) const NONE: Self = Self {
        segment: u32::MAX,
        offset: u32::MAX,
    };

    pub(crate) fn is_some(self) -> bool {
        self.segment != u32::MAX
    }
}

const PERSISTENT: u8 = 1;
const DELIVERED: u8 = 2;
/// `expiry_ms` of a message that never expires.
pub(crate) const NEVER: u64 = u64::MAX;

/// One message held by the queue (80 bytes).
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) seq: SeqId,
    pub(crate) id: u64,
    /// Absolute expiry time; the message is expired once `now_ms > expiry_ms`.
    pub(crate) expiry_ms: u64,
    /// Properties followed by the body; `None` when paged out to the log.
    pub(crate) data: Option<Bytes>,
    pub(crate) props_len: u32,
    pub(crate) body_len: u32,
    pub(crate) store: StoreRef,
    flags: u8,
    /// Its priority, capped at the queue's maximum (0 without priorities).
    pub(crate) priority: u8,
}

impl Entry {
    pub(crate) fn persistent(&self) -> bool {
        self.flags & PERSISTENT != 0
    }

    pub(crate) fn delivered(&self) -> bool {
        self.flags & DELIVERED != 0
    }

    pub(crate) fn set_delivered(&mut self, delivered: bool) {
        self.flags = (self.flags & !DELIVERED) | if delivered { DELIVERED } else { 0 };
    }

    /// A new message, without its data yet; the core gives it its seq.
    pub(crate) fn new_message(msg: &NewMessage, expiry_ms: u64, store: StoreRef) -> Self {
        Self {
            seq: 0,
            id: msg.id,
            expiry_ms,
            data: None,
            props_len: msg.props.len() as u32,
            body_len: msg.body.len() as u32,
            store,
            flags: if msg.persistent { PERSISTENT } else { 0 },
            priority: msg.priority,
        }
    }

    /// A message installed from a snapshot, without its data yet.
    pub(crate) fn from_snapshot(m: &crate::message::SnapshotMessage, store: StoreRef) -> Self {
        let mut e = Self {
            seq: m.seq,
            id: m.id,
            expiry_ms: m.expiry_ms,
            data: None,
            props_len: m.props.len() as u32,
            body_len: m.body.len() as u32,
            store,
            flags: if m.persistent { PERSISTENT } else { 0 },
            priority: m.priority,
        };
        e.set_delivered(m.delivered);
        e
    }

    /// A persistent message read back from the log.
    pub(crate) fn restored(
        meta: PublishMeta,
        props_len: u32,
        body_len: u32,
        data: Option<Bytes>,
        store: StoreRef,
    ) -> Self {
        let mut e = Self {
            seq: meta.seq,
            id: meta.id,
            expiry_ms: meta.expiry_ms,
            data,
            props_len,
            body_len,
            store,
            flags: PERSISTENT,
            priority: meta.priority,
        };
        e.set_delivered(meta.delivered);
        e
    }
}

/// A removed message whose record is in the log (the log must learn of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Removed {
    pub(crate) seq: SeqId,
    pub(crate) store: StoreRef,
    pub(crate) record_len: u64,
}

impl Removed {
    fn of(e: &Entry) -> Self {
        Self {
            seq: e.seq,
            store: e.store,
            record_len: record_len(e.props_len, e.body_len, e.priority),
        }
    }
}

/// Ready and unacked messages of one queue.
#[derive(Debug, Default)]
pub(crate) struct QueueCore {
    ready: Ready,
    unacked: BTreeMap<DeliveryTag, Entry>,
    next_seq: SeqId,
    next_tag: DeliveryTag,
    limits: Limits,
    ready_bytes: u64,
    unacked_bytes: u64,
    dropped: Vec<Dropped>,
    removed: Vec<Removed>,
}

/// Bytes a publish record of a message takes in the log.
pub(crate) fn record_len(props_len: u32, body_len: u32, priority: u8) -> u64 {
    crate::record::publish_overhead(priority) + u64::from(props_len) + u64::from(body_len)
}

impl QueueCore {
    /// An empty queue; a priority queue with priorities `0 ..= max` if
    /// `max_priority` is given.
    pub(crate) fn new(limits: Limits, max_priority: Option<u8>) -> Self {
        Self {
            ready: Ready::new(max_priority),
            next_seq: 1,
            next_tag: 1,
            limits,
            ..Self::default()
        }
    }

    pub(crate) fn next_seq(&self) -> SeqId {
        self.next_seq
    }

    pub(crate) fn limits(&self) -> Limits {
        self.limits
    }

    /// The priority a message asking for `requested` gets (see [`Ready::priority_for`]).
    pub(crate) fn priority_for(&self, requested: u8) -> u8 {
        self.ready.priority_for(requested)
    }

    pub(crate) fn ready_len(&self) -> u64 {
        self.ready.len() as u64
    }

    pub(crate) fn unacked_len(&self) -> u64 {
        self.unacked.len() as u64
    }

    pub(crate) fn ready_bytes(&self) -> u64 {
        self.ready_bytes
    }

    pub(crate) fn unacked_bytes(&self) -> u64 {
        self.unacked_bytes
    }

    /// The expiry time of the head message, if it can expire: when to call `expire`.
    pub(crate) fn head_expiry_ms(&self) -> Option<u64> {
        self.ready
            .front()
            .map(|e| e.expiry_ms)
            .filter(|&t| t != NEVER)
    }

    /// Restores recovered messages (sorted by seq) and the next sequence number.
    pub(crate) fn restore(&mut self, mut msgs: Vec<Entry>, next_seq: SeqId) {
        self.next_seq = self.next_seq.max(next_seq);
        self.ready_bytes += msgs.iter().map(|e| u64::from(e.body_len)).sum::<u64>();
        for e in &mut msgs {
            e.priority = self.ready.priority_for(e.priority);
        }
        self.ready.extend(msgs);
    }

    /// The expiry time a message published at `now_ms` gets.
    pub(crate) fn expiry_for(&self, now_ms: u64, msg: &NewMessage) -> u64 {
        let ttl = match (self.limits.message_ttl_ms, msg.expiration_ms) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        ttl.map_or(NEVER, |t| now_ms.saturating_add(t).min(NEVER - 1))
    }

    /// Adds a message at the tail; its `data` is props ++ body or `None` if paged out.
    pub(crate) fn publish(&mut self, mut entry: Entry) -> SeqId {
        let seq = self.next_seq;
        self.next_seq += 1;
        entry.seq = seq;
        self.ready_bytes += u64::from(entry.body_len);
        self.ready.push_back(entry);
        self.enforce_max_length();
        seq
    }

    /// Takes the next ready message (after dropping expired ones at the head)
    /// and makes it pending ack. Returns its tag, whether it was delivered
    /// before, and the entry.
    pub(crate) fn fetch(&mut self, now_ms: u64) -> Option<(DeliveryTag, bool, &Entry)> {
        self.expire(now_ms);
        let mut e = self.ready.pop_front()?;
        let redelivered = e.delivered();
        e.flags |= DELIVERED;
        let bytes = u64::from(e.body_len);
        self.ready_bytes -= bytes;
        self.unacked_bytes += bytes;
        let tag = self.next_tag;
        self.next_tag += 1;
        // Tags increase, so this appends at the right edge of the tree.
        let entry = self.unacked.entry(tag).or_insert(e);
        Some((tag, redelivered, entry))
    }

    fn take_unacked(&mut self, tag: DeliveryTag) -> Option<Entry> {
        let e = self.unacked.remove(&tag)?;
        self.unacked_bytes -= u64::from(e.body_len);
        Some(e)
    }

    /// Acks a delivery; returns the message.
    pub(crate) fn ack(&mut self, tag: DeliveryTag) -> Option<Entry> {
        let e = self.take_unacked(tag)?;
        self.note_removed(&e);
        Some(e)
    }

    /// Rejects a delivery without requeue.
    pub(crate) fn discard(&mut self, tag: DeliveryTag) -> Option<Entry> {
        let e = self.take_unacked(tag)?;
        self.drop_entry(&e, DropReason::Rejected);
        Some(e)
    }

    /// Puts a delivery back at its original position (in its priority),
    /// marked redelivered.
    pub(crate) fn requeue(&mut self, tag: DeliveryTag) -> bool {
        let Some(e) = self.take_unacked(tag) else {
            return false;
        };
        self.ready_bytes += u64::from(e.body_len);
        self.ready.insert_by_seq(e);
        self.enforce_max_length();
        true
    }

    /// Removes every ready message; returns how many.
    pub(crate) fn purge(&mut self) -> u64 {
        let n = self.ready.len() as u64;
        let mut removed = std::mem::take(&mut self.removed);
        for e in self.ready.drain() {
            if e.store.is_some() {
                removed.push(Removed::of(&e));
            }
        }
        self.removed = removed;
        self.ready_bytes = 0;
        n
    }

    /// Drops expired messages from the head of the ready queue.
    pub(crate) fn expire(&mut self, now_ms: u64) {
        while let Some(front) = self.ready.front() {
            if front.expiry_ms >= now_ms {
                break;
            }
            if let Some(e) = self.ready.pop_front() {
                self.ready_bytes -= u64::from(e.body_len);
                self.drop_entry(&e, DropReason::Expired);
            }
        }
    }

    /// Replaces the limits and applies them.
    pub(crate) fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
        self.enforce_max_length();
    }

    fn enforce_max_length(&mut self) {
        let max_len = self.limits.max_length.unwrap_or(u64::MAX);
        let max_bytes = self.limits.max_length_bytes.unwrap_or(u64::MAX);
        while self.ready.len() as u64 > max_len || self.ready_bytes > max_bytes {
            let Some(e) = self.ready.pop_front() else {
                break;
            };
            self.ready_bytes -= u64::from(e.body_len);
            self.drop_entry(&e, DropReason::MaxLength);
        }
    }

    fn drop_entry(&mut self, e: &Entry, reason: DropReason) {
        self.dropped.push(Dropped {
            seq: e.seq,
            id: e.id,
            reason,
            data: e.data.clone(),
            props_len: e.props_len,
            store: e.store,
        });
        self.note_removed(e);
    }

    fn note_removed(&mut self, e: &Entry) {
        if e.store.is_some() {
            self.removed.push(Removed::of(e));
        }
    }

    /// Messages dropped since the last [`take_dropped`](Self::take_dropped).
    pub(crate) fn dropped_mut(&mut self) -> &mut Vec<Dropped> {
        &mut self.dropped
    }

    /// Messages dropped (expired, over the limits, rejected) since the last call.
    pub(crate) fn take_dropped(&mut self, out: &mut Vec<Dropped>) {
        out.append(&mut self.dropped);
    }

    /// Logged messages removed since the last call (the log must record them).
    pub(crate) fn removed_mut(&mut self) -> &mut Vec<Removed> {
        &mut self.removed
    }

    /// Every message held (ready and unacked), for compaction.
    pub(crate) fn entries_mut(&mut self) -> impl Iterator<Item = &mut Entry> {
        self.ready.iter_mut().chain(self.unacked.values_mut())
    }

    /// Sequence numbers of ready messages, head first.
    pub(crate) fn ready_seqs(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.ready.iter().map(|e| e.seq)
    }

    /// The next delivery tag to be given.
    pub(crate) fn next_tag(&self) -> DeliveryTag {
        self.next_tag
    }

    /// Every message held: ready ones (head first, no tag), then unacked ones by tag.
    pub(crate) fn held(&self) -> impl Iterator<Item = (Option<DeliveryTag>, &Entry)> + '_ {
        self.ready
            .iter()
            .map(|e| (None, e))
            .chain(self.unacked.iter().map(|(t, e)| (Some(*t), e)))
    }

    /// Whether the core holds no message at all.
    pub(crate) fn is_empty(&self) -> bool {
        self.ready.is_empty() && self.unacked.is_empty()
    }

    /// Installs another queue's state into this empty one (for a mirror's
    /// synchronisation): ready entries in seq order (priorities capped),
    /// unacked entries by tag, and the counters.
    pub(crate) fn install(
        &mut self,
        ready: Vec<Entry>,
        unacked: Vec<(DeliveryTag, Entry)>,
        next_seq: SeqId,
        next_tag: DeliveryTag,
        limits: Limits,
    ) {
        self.ready_bytes = ready.iter().map(|e| u64::from(e.body_len)).sum();
        self.unacked_bytes = unacked.iter().map(|(_, e)| u64::from(e.body_len)).sum();
        self.ready.extend(ready);
        self.unacked = unacked.into_iter().collect();
        self.next_seq = next_seq;
        self.next_tag = next_tag;
        self.limits = limits;
    }
}

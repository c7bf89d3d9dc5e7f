//! What replicas of one queue say to each other on the queue's GM ring.

use serde::{Deserialize, Serialize};
use warren_backing_queue::{Limits, Op, SnapshotMessage};
use warren_gm::MemberId;

use crate::held::HeldPublishes;

/// A publisher's identity and its per-publisher sequence number: what a
/// confirm or nack names. A publisher's publishes reach the master in order,
/// so holding `(p, s)` means holding every earlier publish of `p` that reached
/// it. After a master change a publisher must resolve what it had sent the
/// old master (with the new master's `Promoted { held }`) before it publishes
/// to the new one: otherwise a later publish would raise `held` above earlier
/// ones that were lost with the old master.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PublishId {
    /// The publisher (a channel, unique cluster-wide for its lifetime).
    pub publisher: u64,
    /// The publisher's sequence number (AMQP delivery tag of the publish).
    pub seq: u64,
}

/// One ring payload. Every message carries the sender's epoch: the queue
/// record's version at which the current master took over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RingMsg {
    /// The sender's master epoch.
    pub(crate) epoch: u64,
    /// What it says.
    pub(crate) body: Body,
}

/// The body of a [`RingMsg`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Body {
    /// The master took over at this epoch (first message of every epoch).
    Master {
        /// The epoch of the master whose state this one continues (a
        /// promoted mirror's), or 0 for a copy of its own (a new queue, or
        /// one kept or recovered on this node). A mirror that holds
        /// another master's state drops it and asks for a sync: the new
        /// master's ops apply to its state only.
        from: u64,
    },
    /// Backing-queue ops in the order the master applied them, and the
    /// publishes among them.
    Ops {
        /// The ops.
        ops: Vec<Op>,
        /// The publish ids of the `Publish` ops, in order.
        publishes: Vec<PublishId>,
        /// Publishes the master refused (`Replica::publish_refused`),
        /// before those of `publishes`.
        refused: Vec<PublishId>,
    },
    /// The master's synchronised members changed.
    SyncedSet(Vec<MemberId>),
    /// The master is stopping cleanly (promotion follows `ha-promote-on-shutdown`).
    Stopping,
    /// A sync starts: the master's state at this point of its stream follows in batches.
    SyncStart {
        /// The sync's id.
        sync: u64,
        /// The mirrors being synchronised.
        targets: Vec<MemberId>,
        /// Messages to send.
        total: u64,
        /// The master's state at this point (`BackingQueue::digest`): a
        /// target that holds the same keeps it, one that differs receives.
        digest: u64,
    },
    /// Messages of a sync.
    SyncBatch {
        /// The sync's id.
        sync: u64,
        /// The messages.
        msgs: Vec<SnapshotMessage>,
    },
    /// The last part of a sync: counters, limits and held publishes.
    SyncEnd {
        /// The sync's id.
        sync: u64,
        /// Next seq of the master's queue at the sync point.
        next_seq: u64,
        /// Next tag.
        next_tag: u64,
        /// Limits.
        limits: Limits,
        /// Publishes held at the sync point.
        held: HeldPublishes,
    },
    /// The sync was cancelled: its targets drop what they got.
    SyncCancel {
        /// The sync's id.
        sync: u64,
    },
    /// From a mirror that holds nothing: it asks to be synchronised (sent
    /// when it joins, when it starts following a new master, and again now
    /// and then while nothing comes).
    NeedSync {
        /// The newest sync of its current master it has seen start for it
        /// (0: none). The master does not start another for an ask that
        /// predates the sync already on its way to this mirror.
        after: u64,
    },
    /// From a mirror: it holds everything the master holds.
    SyncDone {
        /// The sync's id.
        sync: u64,
    },
    /// From a mirror that holds the master's state, to the master alone (not
    /// round the ring): every persistent message with a queue seq up to
    /// `up_to` is on its disk (its fsync covered it).
    Stored {
        /// The highest queue seq covered.
        up_to: u64,
    },
}

impl RingMsg {
    pub(crate) fn encode(&self) -> bytes::Bytes {
        // Encoding plain data into a Vec cannot fail.
        bytes::Bytes::from(postcard::to_allocvec(self).unwrap_or_default())
    }

    pub(crate) fn decode(b: &[u8]) -> Option<Self> {
        postcard::from_bytes(b).ok()
    }
}

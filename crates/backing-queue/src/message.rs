//! Messages as they enter and leave a backing queue, and the op log.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// A message's position in its queue: assigned at publish, strictly
/// increasing. After a durable queue restarts, numbering continues above every
/// seq its log has seen (transient messages are not logged, so their seqs may
/// be given again after a restart; they are gone by then).
pub type SeqId = u64;

/// Identifies one delivery of a message that is pending acknowledgement.
/// A message that is requeued and fetched again gets a new tag.
pub type DeliveryTag = u64;

/// A message offered to [`publish`](crate::BackingQueue::publish).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewMessage {
    /// The caller's message id (opaque to the queue; mirrors use it to match
    /// publishes that reach them by two routes).
    pub id: u64,
    /// Encoded AMQP content-header properties.
    pub props: Bytes,
    /// The message body.
    pub body: Bytes,
    /// `delivery-mode = 2`: kept on disk when the queue is durable.
    pub persistent: bool,
    /// The per-message `expiration` property, in milliseconds, if any.
    pub expiration_ms: Option<u64>,
    /// The `priority` property (0 if absent); a priority queue caps it at
    /// its maximum, a queue without priorities ignores it.
    pub priority: u8,
}

impl NewMessage {
    /// A message with empty properties, no expiration and priority 0.
    pub fn new(id: u64, body: impl Into<Bytes>, persistent: bool) -> Self {
        Self {
            id,
            props: Bytes::new(),
            body: body.into(),
            persistent,
            expiration_ms: None,
            priority: 0,
        }
    }
}

/// A message handed out by [`fetch`](crate::BackingQueue::fetch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// Tag to ack, requeue or discard this delivery with.
    pub tag: DeliveryTag,
    /// The message's position in the queue.
    pub seq: SeqId,
    /// The caller's message id.
    pub id: u64,
    /// Encoded properties.
    pub props: Bytes,
    /// The body.
    pub body: Bytes,
    /// Whether the message was persistent.
    pub persistent: bool,
    /// AMQP `redelivered`: the message has been delivered before.
    pub redelivered: bool,
    /// Ready messages left after this one.
    pub remaining: u64,
}

/// The result of a publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    /// The sequence number given to the message.
    pub seq: SeqId,
    /// `true` when the message went to the durable log: its confirm must wait
    /// until [`synced_seq`](crate::BackingQueue::synced_seq) reaches `seq`.
    /// `false`: it may be confirmed at once.
    pub needs_sync: bool,
}

/// Queue arguments that policies may change: `x-message-ttl`,
/// `x-max-length`, `x-max-length-bytes` (overflow is always drop-head).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// `x-message-ttl` in milliseconds.
    pub message_ttl_ms: Option<u64>,
    /// `x-max-length`: most ready messages.
    pub max_length: Option<u64>,
    /// `x-max-length-bytes`: most ready body bytes.
    pub max_length_bytes: Option<u64>,
}

/// Why a message left the queue without being acked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DropReason {
    /// Its TTL ran out.
    Expired,
    /// `x-max-length` / `x-max-length-bytes` dropped it from the head.
    MaxLength,
    /// Rejected or nacked without requeue.
    Rejected,
}

/// A message that left the queue without an ack (for dead-lettering), with
/// its content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    /// Its sequence number.
    pub seq: SeqId,
    /// Its message id.
    pub id: u64,
    /// Why it left.
    pub reason: DropReason,
    /// Its properties followed by its body, as published (`None` if a
    /// paged-out message could not be read back).
    pub data: Option<Bytes>,
    /// How many bytes of `data` are properties.
    pub props_len: u32,
    /// Where its record was in the log (to read `data` back).
    pub(crate) store: crate::core::StoreRef,
}

/// One operation on a backing queue, as the master applied it. A mirror that
/// applies the same ops in the same order ends in the same state, with the
/// same sequence numbers and delivery tags (the core is deterministic: time
/// is part of the op, never read from a clock).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    /// Publish a message at time `now_ms`.
    Publish {
        /// Time of the publish (milliseconds, caller's clock).
        now_ms: u64,
        /// The message.
        msg: NewMessage,
    },
    /// Fetch the next ready message at `now_ms` (expired ones at the head are dropped).
    Fetch {
        /// Time of the fetch.
        now_ms: u64,
    },
    /// Ack a delivery.
    Ack {
        /// Its tag.
        tag: DeliveryTag,
    },
    /// Reject/nack with requeue: back to its original position, redelivered.
    Requeue {
        /// Its tag.
        tag: DeliveryTag,
    },
    /// Reject/nack without requeue.
    Discard {
        /// Its tag.
        tag: DeliveryTag,
    },
    /// Remove every ready message.
    Purge,
    /// Drop expired messages from the head.
    Expire {
        /// The current time.
        now_ms: u64,
    },
    /// Change the queue's limits (a policy changed) and apply them.
    SetLimits {
        /// The new limits.
        limits: Limits,
    },
}

impl Op {
    /// Encodes the op with postcard.
    pub fn encode(&self) -> Result<Vec<u8>, postcard::Error> {
        postcard::to_allocvec(self)
    }

    /// Decodes an op encoded by [`Op::encode`].
    pub fn decode(bytes: &[u8]) -> Result<Self, postcard::Error> {
        postcard::from_bytes(bytes)
    }
}

/// One message of a [`Snapshot`]: everything a replica needs to hold it
/// exactly as the queue it was taken from does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotMessage {
    /// Its sequence number.
    pub seq: SeqId,
    /// The caller's message id.
    pub id: u64,
    /// Encoded properties.
    pub props: Bytes,
    /// The body.
    pub body: Bytes,
    /// Whether it is persistent.
    pub persistent: bool,
    /// Absolute expiry time (`u64::MAX`: never).
    pub expiry_ms: u64,
    /// Whether it has been delivered before (`redelivered` at its next delivery).
    pub delivered: bool,
    /// Its delivery tag when it is pending ack; `None` when ready.
    pub tag: Option<DeliveryTag>,
    /// Its priority (capped at the queue's maximum; 0 without priorities).
    pub priority: u8,
}

/// A queue's whole state, for a mirror's synchronisation: installed with
/// [`BackingQueue::install_snapshot`](crate::BackingQueue::install_snapshot),
/// the replica then applies the source's later [`Op`]s with the same results.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// The next sequence number the queue gives.
    pub next_seq: SeqId,
    /// The next delivery tag the queue gives.
    pub next_tag: DeliveryTag,
    /// Its limits.
    pub limits: Limits,
    /// Ready messages head first, then unacked ones by tag.
    pub messages: Vec<SnapshotMessage>,
}

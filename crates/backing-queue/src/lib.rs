//! Warren's backing queue: the messages of one queue, in memory and, for
//! persistent messages of durable queues, in an append-only segment log.
//!
//! - [`BackingQueue`] has RabbitMQ's operations: [`publish`](BackingQueue::publish),
//!   [`fetch`](BackingQueue::fetch) (the message becomes pending ack under a
//!   [`DeliveryTag`]), [`ack`](BackingQueue::ack),
//!   [`requeue`](BackingQueue::requeue) (back to its original position,
//!   redelivered), [`discard`](BackingQueue::discard),
//!   [`purge`](BackingQueue::purge), [`stats`](BackingQueue::stats), per-message
//!   expiry (`x-message-ttl`, `expiration`) and `x-max-length` /
//!   `x-max-length-bytes` with drop-head ([`Limits`]).
//! - Priority queues ([`QueueConfig::max_priority`], `x-max-priority`) as
//!   RabbitMQ's: one FIFO per priority, the highest delivered first; a
//!   message's [`NewMessage::priority`] is capped at the maximum. Expiry,
//!   drop-head and requeue work on that order (requeue: back to the
//!   message's place in its priority); the log records each message's
//!   priority, so recovery restores the order. A queue without priorities
//!   keeps its single FIFO.
//! - Every operation is also an [`Op`] (serde + postcard): a mirror that
//!   applies its master's ops ends in the same state. The bookkeeping is
//!   sans-IO and deterministic: time is an input (`now_ms`), never read.
//! - [`BackingQueue::snapshot`] and [`BackingQueue::install_snapshot`] copy a
//!   queue's whole state (same seqs, same tags) to a fresh replica, for a
//!   mirror's synchronisation.
//! - Durable queues ([`BackingQueue::open`]) log persistent messages with a
//!   CRC32C per record, group-commit with one `fdatasync` for everything
//!   appended since the last ([`BackingQueue::sync`], or
//!   [`prepare_sync`](BackingQueue::prepare_sync) + [`SyncJob::run`] on
//!   another thread; [`SyncJob::run_all`] commits many queues' logs with one
//!   append to the node's [`Journal`] and one `fdatasync`), and confirm a
//!   publish only once that sync covers it
//!   ([`BackingQueue::synced_seq`], [`BackingQueue::drain_confirmed`]).
//!   Segments without live messages are deleted, and the head segment is
//!   compacted when the files hold much more than the live messages.
//!   [`StoreConfig::resident_bytes_max`] pages bodies out (lazy mode).
//! - Recovery replays the log: the confirmed, un-acked persistent messages
//!   come back in order, redelivered if they had been delivered; a torn tail
//!   is cut off; a corrupt record elsewhere is a [`StoreError::Corrupt`]
//!   naming file and offset, or is skipped with [`StoreConfig::skip_corrupt`].
//!
//! - The log's files sit behind the [`Storage`] trait: [`FsStorage`] is the
//!   file system, [`MemStorage`] keeps files in memory with a crash model
//!   (only synced data survives [`MemStorage::crash`]) for simulation.
//!
//! The record format is described in the `record` module's source.

mod core;
mod error;
mod journal;
mod log;
mod message;
mod open_files;
mod queue;
mod ready;
mod record;
mod storage;

pub use error::{QueueError, StoreError};
pub use journal::{CHECKPOINT_BYTES, Journal, JournalReport, remove_log_dir};
pub use log::{RecoveryReport, StoreConfig, SyncJob, UnsyncedHook};
pub use message::{
    Delivery, DeliveryTag, DropReason, Dropped, Limits, NewMessage, Op, Published, SeqId, Snapshot,
    SnapshotMessage,
};
pub use queue::{BackingQueue, LazySnapshot, OpOutcome, QueueConfig, Stats};
pub use storage::{FsStorage, MemStorage, Storage, StorageFile};

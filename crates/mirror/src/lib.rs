//! Warren's mirrored queues: the queue master and mirror roles over the
//! queue's GM ring, promotion and synchronisation.
//!
//! # Layers
//!
//! - [`Replica`]: one replica of one queue as a sans-IO state machine (no
//!   tokio, no clock: time is an input). Its role is [`Role::Master`] or
//!   [`Role::Mirror`]. The master applies every operation (publish, fetch,
//!   ack, requeue, discard, purge, TTL and max-length drops) to its
//!   [`BackingQueue`](warren_backing_queue::BackingQueue) and broadcasts the
//!   resulting [`Op`](warren_backing_queue::Op)s; a mirror that holds the
//!   master's state applies exactly those ops in the same order and never
//!   acts on its own.
//! - The wire types of its ring messages ([`PublishId`]) and the record of
//!   the publishes a copy holds ([`HeldPublishes`]).
//!
//! This crate does no I/O. The broker (`warren_broker`) drives replicas
//! under its lock, and the mirror driver (`warren_mirror_driver`) carries
//! their ring traffic and queue-record compare-and-sets.
//!
//! # The protocol
//!
//! - **Epochs.** Every ring message carries the master's epoch: the queue
//!   record's version at which that master took over. A replica refuses
//!   master messages of an older epoch than the one it follows, and a master
//!   that hears a newer one (or sees the record name another master) is
//!   deposed: it nacks what it had not confirmed and stops.
//! - **Confirms.** A publish is confirmed when the ring confirms the
//!   broadcast carrying it (every member of the current view holds it; when
//!   the view shrinks, what every survivor holds is confirmed), and at least
//!   `ha-min-sync-replicas` members (the master included) are synchronised.
//!   A persistent message of a durable queue also waits until it is on disk
//!   at the master and at every synchronised mirror alive: after each fsync a
//!   mirror broadcasts how far its disk covers the queue's seqs
//!   (`Stored { up_to }`), as RabbitMQ's mirrors confirm only once their
//!   backing queue has the message on disk.
//! - **Deliveries.** A fetch's result is handed out only once the ring holds
//!   the fetch, so a new master never delivers a message again without the
//!   redelivered flag.
//! - **Promotion.** When the master's ring member is gone (removed, and its
//!   alias erased: every message of it that any survivor holds has been
//!   delivered everywhere), the oldest synchronised mirror alive (join order)
//!   proposes itself as master in the queue record (compare-and-set); with
//!   `ha-promote-on-failure` / `-shutdown` = `always` and no synchronised
//!   mirror, the oldest mirror does. The winner becomes master in place at
//!   the record's new version, requeues every delivered-but-unacked message
//!   (redelivered), and reports [`Output::Promoted`] with the publishes it
//!   holds (confirm those, nack the rest) once the ring has its takeover.
//! - **Publishes sent again.** A publisher may instead send its unconfirmed
//!   publishes again, with the same [`PublishId`]s, to the next master (or
//!   to the same one over a new connection): a publish the replica holds is
//!   confirmed, not enqueued twice; the others are new to it. Its publishes
//!   must reach a master in order, each once per connection.
//! - **Synchronisation.** A mirror starts empty and unsynchronised and holds
//!   nothing until a sync: the master snapshots its queue (unacked messages
//!   included) at a point of its op stream and sends it in batches of
//!   `ha-sync-batch-size`, one batch per flush, interleaved with live ops
//!   (the queue keeps serving); the mirror buffers the ops after the sync
//!   point, installs the snapshot, replays them, and tells the master, which
//!   adds it to its synchronised members and commits that to the record.
//!   `automatic` syncs new mirrors at once; `manual` waits for
//!   [`Replica::sync`] (and [`Replica::cancel_sync`]), except that a mirror
//!   of an empty queue is synchronised at once, and the others once the
//!   queue is drained (on the master's next tick).
//!
//! # Where Warren differs from RabbitMQ
//!
//! - An unsynchronised mirror holds nothing (RabbitMQ's hold the tail of the
//!   queue and become synchronised "naturally" once the messages older than
//!   them are consumed); only a sync, or an empty queue, makes it
//!   synchronised: in manual mode the master syncs its unsynchronised
//!   mirrors on the tick that finds the queue drained.
//! - Only messages a consumer may have seen come back `redelivered` after a
//!   failover, not every message.
//! - Sync does not block the queue.

mod held;
mod replica;
mod wire;

pub use held::{HeldPublishes, Holds};
pub use replica::{
    MirrorError, Output, QueueFactory, RecordView, Replica, Role, Settings, Status, SyncProgress,
    SyncStart,
};
pub use warren_gm::MemberId;
pub use wire::PublishId;

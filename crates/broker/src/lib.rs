//! Warren's single-node AMQP 0-9-1 broker core.
//!
//! [`Broker`] holds every vhost, user, exchange, binding and queue and owns
//! the [`warren_amqp::Connection`] state machine of every client
//! connection. A shell (the `warren` binary) keeps it behind one lock: a
//! connection's task feeds the bytes it read with
//! [`Broker::handle_input`] and writes what [`Broker::take_output`] gives
//! in one write; work that leaves output for another connection (a delivery,
//! a confirm, a server-sent cancel) wakes that connection's task through its
//! [`Waker`]. Group commits of durable queues run off the lock
//! ([`Broker::prepare_sync`], [`SyncBatch::run`], [`Broker::complete_sync`]):
//! a publisher confirm for a persistent message on a durable queue is sent
//! only after the fsync that covers it.
//!
//! Durable entities live behind [`meta::MetadataStore`]; [`meta::FileStore`]
//! keeps them in a JSON file rewritten atomically on every change.
//! Users have RabbitMQ's salted SHA-256 password hashes ([`auth`]); the
//! default `guest`/`guest` user may log in from loopback only.

pub mod auth;
mod broker;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod meta;
pub mod names;
mod routing;

pub use broker::alarm::{
    AlarmSet, DiskLimit, MemoryLimit, ResourceSample, ResourceStatus, parse_size,
};
pub use broker::introspect::{
    BindingInfo, ChannelInfo, ConnectionInfo, ConsumerInfo, ExchangeInfo, QueueInfo, RingInfo,
    amqp_to_json, json_to_amqp, json_to_table, table_to_json,
};
pub use broker::link::{GetReplyMsg, LINK_BEHIND_MAX, LINK_PUBLISHES_MAX, LinkMsg, QueueFigures};
pub use broker::mirrored::{MirrorInput, MirrorIo, ReplicaEnd, ReplicaStart};
pub use broker::policies::policy_set;
pub use broker::stats::{
    IoStats, LATENCY_BUCKETS_MS, LatencyHistogram, MessageCounters, Octets, QueueCounters,
    QueueSample,
};
pub use broker::{
    Broker, BrokerConfig, CONSUMER_ACKING_MS, CONSUMER_BEHIND_MAX, CommitDone, ConnId, Departed,
    FLOW_READY_BYTES_MAX, FLOW_READY_MAX, MetaCommit, Moving, Overview, QUEUE_RESIDENT_MAX, Reopen,
    SyncBatch, Waker,
};

/// An error opening or configuring a broker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// The metadata store failed.
    #[error(transparent)]
    Meta(#[from] meta::MetaError),
    /// A durable queue's log (or the node's journal) could not be opened.
    #[error(transparent)]
    Store(#[from] warren_backing_queue::StoreError),
    /// A definition is invalid.
    #[error("{0}")]
    Invalid(String),
}

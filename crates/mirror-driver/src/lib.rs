//! Warren's mirror driver: the production shell around the mirrored queues
//! of one node's broker.
//!
//! The replicas themselves are sans-IO ([`warren_mirror::Replica`], driven
//! under the broker's lock by `warren_broker`); this crate runs everything
//! around them on tokio:
//!
//! - [`MirrorDriver`]: the node's [`GmNode`](warren_gm::GmNode), the
//!   reconciler that places replicas from live policies
//!   (`warren_policy::place`) and points each queue at its master (after a
//!   change of queue records alone, for those queues only), one task per
//!   replica for what is rare (view changes, its queue record, ticks, the
//!   stop), and the hub (`hub.rs`): one task moving every replica's ring
//!   traffic, in turns that serve all the replicas ready at once.
//! - [`MetadataSource`]: what the driver needs of the cluster metadata. The
//!   node passes its Raft store ([`warren_cluster::Cluster`]); in-process
//!   tests pass [`MemMetadata`], which applies the same commands in memory
//!   (or a `Cluster` over the in-memory transport).
//! - [`ClusterRecords`] (a queue's record, a [`RecordStore`]) and
//!   [`ClusterViewAuthority`] (the rings' views, a GM
//!   [`ViewAuthority`](warren_gm::ViewAuthority)) over any source.
//! - [`ClusterDetector`]: the rings' failure detector, following the nodes
//!   the cluster sees up.

#![warn(missing_docs)]

#[cfg(feature = "conformance")]
pub mod conformance;
mod detector;
mod driver;
mod hub;
mod records;
mod seen;
mod source;

pub use detector::ClusterDetector;
pub use driver::{Clock, DriverConfig, MirrorDriver, steady_clock_ms};
pub use hub::HubStats;
pub use records::{ClusterRecords, ClusterViewAuthority, RecordError, RecordStore};
pub use source::{MemMetadata, MetadataSource};

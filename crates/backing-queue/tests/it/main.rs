//! Integration tests of the backing queue (one binary).

mod corruption;
mod crash;
mod group_commit;
mod model;
mod oplog;
mod priority;
mod semantics;

use std::path::Path;

use warren_backing_queue::{BackingQueue, Delivery, QueueConfig, StoreConfig};

/// A small-segment store config, so tests roll and compact segments.
pub(crate) fn small_store() -> StoreConfig {
    StoreConfig {
        segment_bytes: 1024,
        ..StoreConfig::default()
    }
}

/// Opens a durable queue, panicking on error (tests only).
pub(crate) fn open(dir: &Path, store: StoreConfig) -> BackingQueue {
    BackingQueue::open(dir, QueueConfig::default(), store)
        .expect("open queue")
        .0
}

/// Fetches everything ready.
pub(crate) fn drain(q: &mut BackingQueue, now_ms: u64) -> Vec<Delivery> {
    let mut out = Vec::new();
    while let Some(d) = q.fetch(now_ms).expect("fetch") {
        out.push(d);
    }
    out
}

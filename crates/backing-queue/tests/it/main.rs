//! Integration tests of the backing queue (one binary).

mod corruption;
mod crash;
mod group_commit;
mod journal;
mod model;
mod oplog;
mod priority;
mod semantics;

use std::path::Path;

use warren_backing_queue::{BackingQueue, Delivery, Journal, QueueConfig, StoreConfig, SyncJob};

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

/// Commits `queues` together (`SyncJob::run_all`, through `journal` if
/// given) and checks that each is durable up to its `last` publish.
pub(crate) fn commit_together(
    queues: &mut [BackingQueue],
    last: &[u64],
    journal: Option<&Journal>,
) {
    let mut jobs: Vec<SyncJob> = queues
        .iter_mut()
        .map(|q| q.prepare_sync().expect("prepare").expect("durable"))
        .collect();
    let mut refs: Vec<&mut SyncJob> = jobs.iter_mut().collect();
    for res in SyncJob::run_all(&mut refs, journal) {
        res.expect("group commit");
    }
    for ((q, job), &last) in queues.iter_mut().zip(&jobs).zip(last) {
        assert_eq!(q.complete_sync(job).expect("complete"), last);
    }
}

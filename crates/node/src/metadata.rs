//! A single node's metadata commits: the definitions files
//! (`metadata.json` and its change log `metadata.log`) written off the
//! broker's lock.
//!
//! The broker keeps every change to durable entities for
//! [`Broker::take_commits`](warren_broker::Broker::take_commits), in the order it made them (a client's declare
//! waits for its own; `FileStore::committer`). This task takes what is
//! pending, appends all of it to the log in one write and one fdatasync
//! however many clients declared meanwhile, then reports each commit done, so that its
//! client gets its reply. A write that fails (a full disk) is tried again
//! every second, in order, with the waiting clients still waiting: a change
//! is answered only once the file holds it, and no later change reaches the
//! file before it. A cluster's nodes commit through Raft instead
//! (`cluster.rs`).

use std::time::Duration;

use tokio::sync::{Notify, watch};
use warren_broker::meta::{Change, FileCommitter};

use crate::{Shared, lock};

/// How long after a failed write the next try comes.
const RETRY_EVERY: Duration = Duration::from_secs(1);

/// Runs the commits until `stop` is set, then writes what is still pending
/// and returns.
pub(crate) async fn commit_loop(
    broker: Shared,
    committer: FileCommitter,
    wake: std::sync::Arc<Notify>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let batch = lock(&broker).take_commits();
        if batch.is_empty() {
            if *stop.borrow() {
                return;
            }
            tokio::select! {
                () = wake.notified() => {}
                _ = stop.changed() => {}
            }
            continue;
        }
        let changes: Vec<Change> = batch.iter().flat_map(|c| c.changes.clone()).collect();
        let mut failed = false;
        loop {
            let (c, ch) = (committer.clone(), changes.clone());
            let written = tokio::task::spawn_blocking(move || c.commit(&ch)).await;
            match written {
                Ok(Ok(())) => break,
                Ok(Err(e)) if !failed => {
                    tracing::error!(error = %e, changes = changes.len(), "writing the metadata file failed; retrying every second");
                    failed = true;
                }
                Ok(Err(_)) => {}
                Err(e) => tracing::error!(error = %e, "the metadata write task failed"),
            }
            if *stop.borrow() {
                tracing::warn!(
                    changes = changes.len(),
                    "stopping with metadata changes not written"
                );
                return;
            }
            tokio::time::sleep(RETRY_EVERY).await;
        }
        if failed {
            tracing::info!("the metadata file is written again");
        }
        let policies = changes
            .iter()
            .any(|c| matches!(c, Change::PutPolicy(_) | Change::DeletePolicy { .. }));
        let mut b = lock(&broker);
        for commit in batch {
            b.commit_done(commit.ticket, Ok(()));
        }
        if policies {
            // The broker reads its policies from the store: now they are there.
            let defs = b.policies();
            b.apply_policies(&defs);
        }
    }
}

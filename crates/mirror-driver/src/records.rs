//! A queue's record and its ring's views in the cluster metadata:
//! [`RecordStore`] (read, compare-and-set, change notices) with
//! [`ClusterRecords`], and the GM [`ViewAuthority`] [`ClusterViewAuthority`],
//! both over any [`MetadataSource`].

use async_trait::async_trait;
use tokio::sync::watch;
use warren_cluster::{Cluster, ClusterError, Command, Outcome, QueueRecord, QueueView, Rejection};
use warren_gm::{View, ViewAuthority, ViewChange, ViewError, ViewVersion};
use warren_mirror::RecordView;

use crate::MetadataSource;

/// Why a record read or compare-and-set failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// The record moved on: here is the current one.
    #[error("queue record conflict (now at version {})", .0.version)]
    Conflict(RecordView),
    /// The store could not answer (no majority, stopped).
    #[error("queue record store: {0}")]
    Unavailable(String),
    /// The queue was deleted (and perhaps declared again since): this
    /// record is no more.
    #[error("the queue was deleted")]
    Gone,
}

/// Where a queue's record lives: read, compare-and-set, and change notices.
///
/// Contract: `compare_and_set` sets the placement only if the record is at
/// `expected` (the version inside `view` is ignored), and the version then
/// grows by exactly one; at any other version it is
/// [`RecordError::Conflict`] with the current record, so of racing writers
/// exactly one wins. A placement the store refuses (the master also a
/// mirror, a mirror twice, a synchronised node that is no mirror) is
/// [`RecordError::Unavailable`] and changes nothing; once the queue is
/// deleted both are [`RecordError::Gone`]. `local` never runs
/// ahead of the store and catches up; a `changes` receiver sees every
/// change made after it was taken. The suite `conformance::record_store`
/// (feature `conformance`) checks this.
#[async_trait]
pub trait RecordStore: Send + Sync + std::fmt::Debug {
    /// The record as this node knows it (may be stale).
    fn local(&self) -> Result<RecordView, RecordError>;
    /// Sets `view`'s placement if the record is at `expected`; returns the new record.
    async fn compare_and_set(
        &self,
        expected: u64,
        view: &RecordView,
    ) -> Result<RecordView, RecordError>;
    /// A receiver that changes whenever the record may have changed.
    fn changes(&self) -> watch::Receiver<u64>;
}

fn record_view(q: &QueueRecord) -> RecordView {
    RecordView {
        version: q.view_version,
        master: q.master.clone(),
        mirrors: q.mirrors.clone(),
        synchronised: q.synchronised.clone(),
    }
}

/// A queue's record in the cluster metadata (the Raft store on a node):
/// one declaration of it, so once the queue is deleted (and perhaps
/// declared again) the record is unavailable.
#[derive(Debug, Clone)]
pub struct ClusterRecords<S = Cluster> {
    source: S,
    vhost: String,
    name: String,
    serial: u64,
}

impl<S: MetadataSource> ClusterRecords<S> {
    /// The record of queue `name` in `vhost` as declared the `serial`th
    /// time ([`QueueRecord::serial`]).
    pub fn new(source: S, vhost: impl Into<String>, name: impl Into<String>, serial: u64) -> Self {
        Self {
            source,
            vhost: vhost.into(),
            name: name.into(),
            serial,
        }
    }

    /// The record, if the queue is still this declaration.
    fn find<'m>(&self, meta: &'m warren_cluster::Metadata) -> Option<&'m QueueRecord> {
        meta.queue(&self.vhost, &self.name)
            .filter(|q| q.serial == self.serial)
    }
}

#[async_trait]
impl<S: MetadataSource> RecordStore for ClusterRecords<S> {
    fn local(&self) -> Result<RecordView, RecordError> {
        self.find(&self.source.local())
            .map(record_view)
            .ok_or(RecordError::Gone)
    }

    async fn compare_and_set(
        &self,
        expected: u64,
        view: &RecordView,
    ) -> Result<RecordView, RecordError> {
        let cmd = Command::SetQueueView {
            vhost: self.vhost.clone(),
            name: self.name.clone(),
            serial: self.serial,
            expected_version: expected,
            view: QueueView {
                master: view.master.clone(),
                mirrors: view.mirrors.clone(),
                synchronised: view.synchronised.clone(),
            },
        };
        match self.source.write(cmd).await {
            Ok(Outcome::Queue(q)) => Ok(record_view(&q)),
            Ok(other) => Err(RecordError::Unavailable(format!(
                "unexpected outcome {other:?}"
            ))),
            Err(ClusterError::Rejected(Rejection::NoQueue { .. })) => Err(RecordError::Gone),
            Err(ClusterError::Rejected(Rejection::ViewConflict { .. })) => {
                let meta = self
                    .source
                    .read_linearizable()
                    .await
                    .map_err(|e| RecordError::Unavailable(e.to_string()))?;
                self.find(&meta)
                    .map(|q| RecordError::Conflict(record_view(q)))
                    .ok_or(RecordError::Gone)
                    .and_then(Err)
            }
            Err(e) => Err(RecordError::Unavailable(e.to_string())),
        }
    }

    fn changes(&self) -> watch::Receiver<u64> {
        self.source.changes()
    }
}

/// A [`ViewAuthority`] for GM rings whose views live in the cluster
/// metadata: each view is postcard-encoded in the ring's register
/// ([`Command::SetRingView`]), whose version is the view's version, so every
/// ring change is a compare-and-set committed by a majority. A node in a
/// minority reads its last applied view and cannot change any.
#[derive(Debug, Clone)]
pub struct ClusterViewAuthority<S = Cluster> {
    source: S,
}

impl<S: MetadataSource> ClusterViewAuthority<S> {
    /// An authority over this node's metadata.
    pub fn new(source: S) -> Self {
        Self { source }
    }

    fn decode(bytes: Option<&[u8]>) -> View {
        bytes
            .and_then(|b| postcard::from_bytes(b).ok())
            .unwrap_or_else(View::empty)
    }

    fn local_view(&self, ring: &str) -> View {
        Self::decode(
            self.source
                .local()
                .rings
                .get(ring)
                .map(|r| r.view.as_slice()),
        )
    }
}

#[async_trait]
impl<S: MetadataSource> ViewAuthority for ClusterViewAuthority<S> {
    async fn current(&self, ring: &str) -> Result<View, ViewError> {
        // A stale view would make the ring drop a proposal (a removal or an
        // erasure it thinks already done), so try hard for a fresh one.
        for _ in 0..3 {
            if let Ok(meta) = self.source.read_linearizable().await {
                return Ok(Self::decode(
                    meta.rings.get(ring).map(|r| r.view.as_slice()),
                ));
            }
        }
        // In a minority: what this node applied (it cannot change anything anyway).
        Ok(self.local_view(ring))
    }

    async fn current_local(&self, ring: &str) -> Result<View, ViewError> {
        // What this node applied: no round trip to the leader (the GM
        // driver's poll reads 1,000 rings a second on a node with 1,000
        // queues; linearizable, that was a fifth of an idle node's CPU).
        Ok(self.local_view(ring))
    }

    async fn update(
        &self,
        ring: &str,
        expected: ViewVersion,
        change: ViewChange,
    ) -> Result<View, ViewError> {
        let current = self.current(ring).await?;
        if current.version != expected {
            return Err(ViewError::Conflict {
                expected,
                current: current.version,
            });
        }
        let next = current.apply(&change)?;
        let bytes = postcard::to_allocvec(&next).map_err(|_| ViewError::Conflict {
            expected,
            current: current.version,
        })?;
        let cmd = Command::SetRingView {
            ring: ring.into(),
            expected_version: expected,
            view: bytes,
        };
        match self.source.write(cmd).await {
            Ok(Outcome::Ring(_)) => Ok(next),
            Err(ClusterError::Rejected(Rejection::ViewConflict { current, .. })) => {
                Err(ViewError::Conflict { expected, current })
            }
            Ok(other) => {
                tracing::warn!(%ring, outcome = ?other, "ring view change: unexpected outcome");
                Err(ViewError::Conflict {
                    expected,
                    current: expected,
                })
            }
            Err(e) => {
                tracing::warn!(%ring, error = %e, "ring view change not committed");
                Err(ViewError::Unavailable(e.to_string()))
            }
        }
    }
}

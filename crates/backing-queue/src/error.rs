//! Errors of the backing queue and its segment log.

use std::path::PathBuf;

/// An error from the durable segment log.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// An I/O operation on a store file failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file or directory concerned.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A record in the middle of the log is damaged. Open the store with
    /// `skip_corrupt` to drop it and carry on.
    #[error("corrupt record in {file} at byte offset {offset}: {reason}")]
    Corrupt {
        /// The segment file.
        file: PathBuf,
        /// Byte offset of the damaged record within the file.
        offset: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// A message is too large to be stored as one record.
    #[error("message of {len} bytes is over the maximum record size of {max} bytes")]
    RecordTooLarge {
        /// Bytes the record would need.
        len: u64,
        /// The maximum record size.
        max: u64,
    },
    /// A sync job was completed out of order, or before it ran (it failed or
    /// was lost). The log is poisoned from then on.
    #[error("sync job {got} completed out of order or without running (expected {expected})")]
    SyncOutOfOrder {
        /// The generation the log expected next.
        expected: u64,
        /// The generation that was completed.
        got: u64,
    },
    /// An earlier sync failed or was lost, so no later confirm can be
    /// trusted: reopen the queue (recovery) to go on.
    #[error("the log is poisoned by an earlier failed or lost sync; reopen the queue")]
    Poisoned,
}

impl StoreError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

/// An error from a backing-queue operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QueueError {
    /// The delivery tag is not pending acknowledgement (never issued, or
    /// already acked, rejected or requeued). AMQP: `PRECONDITION_FAILED`.
    #[error("unknown delivery tag {0}")]
    UnknownDeliveryTag(u64),
    /// The durable store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

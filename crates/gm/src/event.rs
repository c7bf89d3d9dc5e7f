//! What a ring member tells its application: part of the sans-IO core, so
//! that replication logic above the ring (the `mirror` crate) can consume
//! ring events without the tokio driver.

use bytes::Bytes;

use crate::frame::Seq;
use crate::view::{MemberId, ViewVersion};

/// What a ring member tells its application.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RingEvent {
    /// A broadcast, delivered (exactly once, in its publisher's order).
    Deliver {
        /// Who broadcast it.
        publisher: MemberId,
        /// Its sequence number.
        seq: Seq,
        /// The payload.
        payload: Bytes,
    },
    /// Own broadcasts up to `up_to` are held by every member of the view.
    Confirm {
        /// Highest confirmed sequence number.
        up_to: Seq,
    },
    /// A view was installed.
    View {
        /// Its version.
        version: ViewVersion,
    },
    /// The member is out of the ring (removed, or its join failed); join again to continue.
    Removed,
    /// A message from one member of the ring to this one alone (sent with
    /// `RingHandle::send` (the driver)): not ordered with broadcasts, lost if the link
    /// between their nodes breaks.
    Message {
        /// The sender.
        from: MemberId,
        /// The payload.
        payload: Bytes,
    },
    /// The connection to a node holding members of this ring was replaced:
    /// point-to-point messages sent to them may have been lost (broadcasts
    /// are not: the ring resends them).
    LinkReset,
}

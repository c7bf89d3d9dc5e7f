//! The frames ring members send to their neighbours.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::view::{MemberId, ViewVersion};

/// A broadcast's sequence number: per publisher, from 1, without gaps.
pub type Seq = u64;

/// One broadcast message as it travels round the ring.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pub {
    /// Its sequence number in its publisher's stream.
    pub seq: Seq,
    /// The publisher's view version when it was broadcast (joiners of a later
    /// view do not deliver it).
    pub view: ViewVersion,
    /// The payload.
    pub payload: Bytes,
}

/// What one frame carries about one publisher's stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamBatch {
    /// The publisher.
    pub publisher: MemberId,
    /// Publishes, in sequence order.
    pub pubs: Vec<Pub>,
    /// Cumulative ack: every message up to here has gone all the way round (0: none).
    pub ack: Seq,
}

/// What a frame asks of its receiver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FrameKind {
    /// Publishes and acks to pass on (gm.erl's `activity`).
    Activity,
    /// The sender's whole state, pending messages included (gm.erl's
    /// `catchup`): sent to the right neighbour after every view change and
    /// after a link reset. Idempotent. A large one is split over several
    /// frames; a joiner takes its state from a whole one only.
    Catchup {
        /// Whether this is the catchup's last frame.
        last: bool,
    },
    /// "Send me a catchup": a right neighbour that lost frames asks its left.
    NeedCatchup,
}

/// One frame between ring neighbours. Frames of an older view are refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Frame {
    /// The sender's view version.
    pub view: ViewVersion,
    /// The sender.
    pub from: MemberId,
    /// What the frame is.
    pub kind: FrameKind,
    /// Per-publisher publishes and acks.
    pub streams: Vec<StreamBatch>,
}

impl Frame {
    /// Encodes the frame with postcard (the body of a `PeerFrame::Ring`).
    pub fn encode(&self) -> Result<Vec<u8>, warren_wire::WireError> {
        warren_wire::encode_message(self)
    }

    /// Decodes a frame; malformed bytes are an error, never a panic.
    pub fn decode(bytes: &[u8]) -> Result<Self, warren_wire::WireError> {
        warren_wire::decode_message(bytes)
    }
}

/// Bytes a pub adds to a frame beyond its payload (an estimate for batching).
pub(crate) const PUB_OVERHEAD: usize = 24;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_garbage_is_an_error() {
        let frame = Frame {
            view: 7,
            from: MemberId(3),
            kind: FrameKind::Catchup { last: true },
            streams: vec![StreamBatch {
                publisher: MemberId(1),
                pubs: vec![Pub {
                    seq: 5,
                    view: 6,
                    payload: Bytes::from_static(b"hello"),
                }],
                ack: 4,
            }],
        };
        let bytes = frame.encode().unwrap();
        assert_eq!(Frame::decode(&bytes).unwrap(), frame);
        assert!(Frame::decode(&bytes[..bytes.len() - 1]).is_err());
        assert!(Frame::decode(&[0xff; 3]).is_err());
    }
}

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

/// A [`Pub`] decoded in place: its payload borrows the received buffer.
#[derive(Deserialize)]
struct PubRef<'a> {
    seq: Seq,
    view: ViewVersion,
    payload: &'a [u8],
}

/// A [`StreamBatch`] decoded in place.
#[derive(Deserialize)]
struct StreamBatchRef<'a> {
    publisher: MemberId,
    #[serde(borrow)]
    pubs: Vec<PubRef<'a>>,
    ack: Seq,
}

/// A [`Frame`] decoded in place (same wire format), turned into a [`Frame`]
/// whose payloads share the received buffer instead of copying it.
#[derive(Deserialize)]
pub(crate) struct FrameRef<'a> {
    view: ViewVersion,
    from: MemberId,
    kind: FrameKind,
    #[serde(borrow)]
    streams: Vec<StreamBatchRef<'a>>,
}

impl FrameRef<'_> {
    /// The owned frame; `buf` must hold the bytes this was decoded from.
    pub(crate) fn into_frame(self, buf: &Bytes) -> Frame {
        Frame {
            view: self.view,
            from: self.from,
            kind: self.kind,
            streams: self
                .streams
                .into_iter()
                .map(|b| StreamBatch {
                    publisher: b.publisher,
                    ack: b.ack,
                    pubs: b
                        .pubs
                        .into_iter()
                        .map(|p| Pub {
                            seq: p.seq,
                            view: p.view,
                            payload: buf.slice_ref(p.payload),
                        })
                        .collect(),
                })
                .collect(),
        }
    }
}

impl Frame {
    /// Decodes a frame whose payloads share `bytes` (no copy per message).
    pub fn decode_shared(bytes: &Bytes) -> Result<Self, warren_wire::WireError> {
        let frame: FrameRef<'_> = decode_borrowed(bytes)?;
        Ok(frame.into_frame(bytes))
    }
}

/// Decodes a postcard message that borrows from `bytes`; trailing bytes are an error.
pub(crate) fn decode_borrowed<'a, T: Deserialize<'a>>(
    bytes: &'a [u8],
) -> Result<T, warren_wire::WireError> {
    let malformed = |reason: String| warren_wire::WireError::Malformed {
        what: std::any::type_name::<T>(),
        reason,
    };
    let (msg, rest) = postcard::take_from_bytes(bytes).map_err(|e| malformed(e.to_string()))?;
    if !rest.is_empty() {
        return Err(malformed(format!("{} trailing bytes", rest.len())));
    }
    Ok(msg)
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
        let shared = Bytes::from(bytes.clone());
        assert_eq!(Frame::decode_shared(&shared).unwrap(), frame);
        assert!(Frame::decode_shared(&shared.slice(1..)).is_err());
        assert!(Frame::decode(&bytes[..bytes.len() - 1]).is_err());
        assert!(Frame::decode(&[0xff; 3]).is_err());
    }
}

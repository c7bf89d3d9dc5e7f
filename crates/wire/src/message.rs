//! The typed frames that nodes exchange once a connection is authenticated.

use bytes::Bytes;
use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::WireError;

/// One frame between two authenticated nodes.
///
/// Many subsystems share one connection per pair of nodes; each frame says
/// whose it is. Bodies are opaque here and decoded by their owner (the GM
/// ring, the metadata store, the queue roles) with [`decode_message`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum PeerFrame {
    /// Liveness for the node-level failure detector; `seq` grows per sender.
    Heartbeat {
        /// The sender's heartbeat counter.
        seq: u64,
    },
    /// A frame of one GM ring (one ring per mirrored queue).
    Ring {
        /// The ring's name (its queue's resource name).
        ring: String,
        /// The ring member's frame.
        body: Bytes,
    },
    /// A frame of the cluster metadata store.
    Metadata {
        /// The metadata store's frame.
        body: Bytes,
    },
    /// Liveness for the node-level failure detector, with what the sender
    /// hears of the receiver: a node that the other end no longer hears is
    /// cut off from it one way, and counts it down too.
    Heard {
        /// How long ago (ms) the sender last received anything from the
        /// receiver; `None`: never since it started.
        silent_ms: Option<u64>,
        /// The sender leads the cluster metadata's Raft group, or follows
        /// a leader it heard within the leader lease: it would refuse the
        /// receiver a vote (what a Raft pre-vote asks).
        leader_live: bool,
        /// Non-zero: the receiver answers at once with its own `Heard`
        /// echoing this number (a node that lost its leader asks whether a
        /// majority hears it now, not only before a cut).
        ask: u64,
        /// The `ask` of the sender's peer this frame answers (0: none).
        echo: u64,
    },
    /// The sender is stopping cleanly (a graceful stop, not a crash): its
    /// peers see it go at info level, not as a fault.
    Leaving,
}

/// Encodes a peer message with postcard.
pub fn encode_message<T: Serialize>(msg: &T) -> Result<Vec<u8>, WireError> {
    postcard::to_stdvec(msg).map_err(|e| WireError::Malformed {
        what: std::any::type_name::<T>(),
        reason: e.to_string(),
    })
}

/// Encodes `PeerFrame::Ring { ring, body: encode_message(msg) }` in one pass:
/// the body is written straight after the header into a buffer of the exact
/// size, instead of into a buffer of its own that is then copied. Byte
/// strings are copied whole (a large message's body is one `memcpy`, even
/// where postcard is built without optimisations).
pub fn encode_ring_frame<T: Serialize>(ring: &str, msg: &T) -> Result<Vec<u8>, WireError> {
    let malformed = |e: postcard::Error| WireError::Malformed {
        what: std::any::type_name::<T>(),
        reason: e.to_string(),
    };
    let body_len = postcard::experimental::serialized_size(msg).map_err(malformed)?;
    let head = PeerFrameHead::Ring {
        ring,
        body_len: body_len as u64,
    };
    let head_len = postcard::experimental::serialized_size(&head).map_err(malformed)?;
    let mut out = vec![0; head_len + body_len];
    let (head_buf, body_buf) = out.split_at_mut(head_len);
    postcard::to_slice(&head, head_buf).map_err(malformed)?;
    postcard::to_slice(msg, body_buf).map_err(malformed)?;
    Ok(out)
}

/// The start of a [`PeerFrame`] up to a ring frame's body: the same variants
/// in the same order, and the body's length where the body's bytes begin
/// (postcard writes a byte string's length as a varint, like a `u64`).
#[derive(Serialize)]
enum PeerFrameHead<'a> {
    #[allow(dead_code, reason = "holds Ring's variant index in place")]
    Heartbeat {
        seq: u64,
    },
    Ring {
        ring: &'a str,
        body_len: u64,
    },
}

/// Decodes a peer message; trailing bytes are an error.
pub fn decode_message<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, WireError> {
    let malformed = |reason: String| WireError::Malformed {
        what: std::any::type_name::<T>(),
        reason,
    };
    let (msg, rest) = postcard::take_from_bytes(bytes).map_err(|e| malformed(e.to_string()))?;
    if !rest.is_empty() {
        return Err(malformed(format!("{} trailing bytes", rest.len())));
    }
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trips_every_variant() {
        for frame in [
            PeerFrame::Heartbeat { seq: 42 },
            PeerFrame::Ring {
                ring: "/hello".into(),
                body: Bytes::from_static(b"pub"),
            },
            PeerFrame::Metadata { body: Bytes::new() },
            PeerFrame::Heard {
                silent_ms: Some(7),
                leader_live: true,
                ask: 3,
                echo: 2,
            },
            PeerFrame::Leaving,
        ] {
            let bytes = encode_message(&frame).unwrap();
            assert_eq!(decode_message::<PeerFrame>(&bytes).unwrap(), frame);
        }
    }

    #[test]
    fn trailing_bytes_are_refused() {
        let mut bytes = encode_message(&PeerFrame::Heartbeat { seq: 1 }).unwrap();
        bytes.push(0);
        let err = decode_message::<PeerFrame>(&bytes).unwrap_err();
        assert!(err.to_string().contains("trailing"), "{err}");
    }

    proptest! {
        #[test]
        fn a_ring_frame_encoded_in_one_pass_is_the_two_pass_encoding(
            ring in ".{0,40}",
            body in proptest::collection::vec(any::<u8>(), 0..3000),
            seq in any::<u64>(),
        ) {
            let msg = (seq, Bytes::from(body));
            let two_pass = encode_message(&PeerFrame::Ring {
                ring: ring.clone(),
                body: Bytes::from(encode_message(&msg).unwrap()),
            })
            .unwrap();
            prop_assert_eq!(encode_ring_frame(&ring, &msg).unwrap(), two_pass);
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_message::<PeerFrame>(&bytes);
        }
    }
}

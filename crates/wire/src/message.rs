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
}

/// Encodes a peer message with postcard.
pub fn encode_message<T: Serialize>(msg: &T) -> Result<Vec<u8>, WireError> {
    postcard::to_stdvec(msg).map_err(|e| WireError::Malformed {
        what: std::any::type_name::<T>(),
        reason: e.to_string(),
    })
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
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_message::<PeerFrame>(&bytes);
        }
    }
}

//! Warren's peer protocol: the bytes that nodes exchange.
//!
//! Three layers, all sans-IO (no sockets, no clock, no randomness of their own):
//!
//! - [`frame`]: the length-prefixed envelope. Every frame on a byte stream is a
//!   4-byte big-endian length followed by that many bytes, or, when longer
//!   than one chunk ([`MAX_CHUNK_LEN`], 16 MiB), pieces of at most a chunk
//!   that the receiver joins. A frame longer than the configured maximum is
//!   refused with [`WireError::FrameTooLarge`].
//! - [`handshake`]: the first frames on every new connection. Both sides
//!   exchange the protocol version, their node name and a nonce, then prove
//!   they know the cluster secret with an HMAC-SHA256 over both nonces and both
//!   names. The secret itself never crosses the wire.
//! - [`message`]: the typed peer frames ([`PeerFrame`]) carried after the
//!   handshake, encoded with postcard.

pub mod frame;
pub mod fuzz;
pub mod handshake;
pub mod message;
mod node;

pub use frame::{
    DEFAULT_MAX_FRAME_LEN, FrameDecoder, FrameEncoder, LEN_PREFIX, MAX_CHUNK_LEN, encode_frame,
};
pub use handshake::{
    ClusterSecret, HANDSHAKE_MAX_FRAME_LEN, Handshake, HandshakeError, HandshakeStep,
    PROTOCOL_VERSION, RefuseReason, Role,
};
pub use message::{PeerFrame, decode_message, encode_message, encode_ring_frame};
pub use node::{NodeName, NodeNameError};

/// Errors from decoding or encoding peer frames.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WireError {
    /// A frame (announced by a peer or offered by a caller) is over the maximum size.
    #[error("frame of {len} bytes is over the maximum frame size of {max} bytes")]
    FrameTooLarge {
        /// The frame's length in bytes.
        len: usize,
        /// The configured maximum.
        max: usize,
    },
    /// The bytes of a frame are not a valid message of the expected type.
    #[error("malformed {what}: {reason}")]
    Malformed {
        /// What was being decoded.
        what: &'static str,
        /// postcard's description of the problem.
        reason: String,
    },
}

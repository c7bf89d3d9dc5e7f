//! Transport errors.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use warren_wire::{HandshakeError, WireError};

use crate::PeerAddr;

/// Why a transport operation failed. Every variant means the connection (or
/// the attempt) is over; it names what went wrong and where.
#[derive(Debug, thiserror::Error, Clone)]
#[non_exhaustive]
pub enum TransportError {
    /// Nothing accepted a connection at the address (or it is unreachable).
    #[error("could not connect to {addr}: {source}")]
    Connect {
        /// The address dialed.
        addr: PeerAddr,
        /// The OS or transport error.
        source: Arc<io::Error>,
    },
    /// Dialing took longer than the connect timeout.
    #[error("connecting to {addr} timed out after {after:?}")]
    ConnectTimeout {
        /// The address dialed.
        addr: PeerAddr,
        /// The timeout that expired.
        after: Duration,
    },
    /// The peer was refused or refused us during the handshake.
    #[error("handshake with {addr} failed: {source}")]
    Handshake {
        /// The peer's address.
        addr: PeerAddr,
        /// What went wrong (version, secret, garbage).
        source: HandshakeError,
    },
    /// The handshake took longer than its timeout.
    #[error("handshake with {addr} timed out after {after:?}")]
    HandshakeTimeout {
        /// The peer's address.
        addr: PeerAddr,
        /// The timeout that expired.
        after: Duration,
    },
    /// A frame is over the maximum frame size (ours, or announced by the peer).
    #[error("frame refused: {0}")]
    FrameTooLarge(WireError),
    /// The peer's bytes broke the framing (the pieces of a split frame out
    /// of sequence).
    #[error("frames refused: {0}")]
    Malformed(WireError),
    /// Listening on an address failed.
    #[error("could not listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: PeerAddr,
        /// The OS or transport error.
        source: Arc<io::Error>,
    },
    /// The connection broke (reset, cut, partition, peer crash).
    #[error("connection to {peer} lost: {reason}")]
    ConnectionLost {
        /// The peer's node name or address.
        peer: String,
        /// What was observed.
        reason: String,
    },
    /// The connection or listener was closed by this side.
    #[error("connection closed")]
    Closed,
    /// TLS or certificate set-up failed.
    #[error("TLS: {0}")]
    Tls(String),
}

impl TransportError {
    /// Whether nothing listens at the dialed address (the OS refused the
    /// connection): on one machine or a LAN that means the process is gone.
    #[must_use]
    pub fn is_refused(&self) -> bool {
        matches!(self, Self::Connect { source, .. } if source.kind() == io::ErrorKind::ConnectionRefused)
    }

    /// A lost connection, from an I/O error.
    pub fn lost(peer: impl Into<String>, err: &io::Error) -> Self {
        Self::ConnectionLost {
            peer: peer.into(),
            reason: err.to_string(),
        }
    }
}

//! What every transport needs to know about the node it serves.

use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

use warren_wire::{ClusterSecret, DEFAULT_MAX_FRAME_LEN, MAX_CHUNK_LEN, NodeName};

/// How many connections a listener authenticates at once by default.
const DEFAULT_MAX_PENDING_HANDSHAKES: usize = 64;

/// Where a peer listens: `host:port` for TCP and QUIC, a name for the in-memory transport.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PeerAddr(String);

impl PeerAddr {
    /// Wraps an address string.
    pub fn new(addr: impl Into<String>) -> Self {
        Self(addr.into())
    }

    /// The address as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for PeerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl From<&str> for PeerAddr {
    fn from(s: &str) -> Self {
        Self::new(s)
    }
}

impl From<std::net::SocketAddr> for PeerAddr {
    fn from(s: std::net::SocketAddr) -> Self {
        Self::new(s.to_string())
    }
}

/// Settings shared by every transport.
#[derive(Debug, Clone)]
pub struct TransportConfig {
    /// This node's name, proven to peers in the handshake.
    pub node: NodeName,
    /// The cluster secret both ends must share.
    pub secret: ClusterSecret,
    /// The largest frame sent or accepted, in bytes.
    pub max_frame_len: usize,
    /// Frames longer than this go on byte streams in pieces of at most this
    /// many bytes (at most, and by default, [`MAX_CHUNK_LEN`]), and frames
    /// of other lanes between them; shorter frames go whole.
    pub chunk_len: usize,
    /// How long dialing may take before it fails.
    pub connect_timeout: Duration,
    /// How long the handshake may take before it fails (for TCP with TLS,
    /// the TLS handshake and the cluster handshake together).
    pub handshake_timeout: Duration,
    /// How many accepted connections a listener authenticates at once;
    /// connections beyond are closed unauthenticated (see [`crate::HandshakeSlots`]).
    pub max_pending_handshakes: usize,
    /// The local address to bind before dialing (so firewall rules between
    /// nodes on 127.0.0.2, .3, … see the node's own address). `None` lets the
    /// OS choose.
    pub bind_ip: Option<IpAddr>,
    /// How long data sent on a connection may go unacknowledged by the
    /// peer's network stack before the connection is given up (TCP's
    /// `TCP_USER_TIMEOUT`; a peer that acknowledges but does not read is
    /// not affected). A connection that a lossy or cut network left in
    /// retransmission backoff then fails, and its user dials a new one,
    /// instead of waiting seconds after the network heals for the next
    /// retransmission. `None`: the system's timeouts (many minutes).
    pub unacked_timeout: Option<Duration>,
}

impl TransportConfig {
    /// Defaults: 257 MiB frames in 16 MiB pieces, 5 s connect and handshake
    /// timeouts, 64 handshakes at once per listener, OS-chosen source
    /// address, connections given up after 2 s of unacknowledged data.
    pub fn new(node: NodeName, secret: ClusterSecret) -> Self {
        Self {
            node,
            secret,
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
            chunk_len: MAX_CHUNK_LEN,
            connect_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            max_pending_handshakes: DEFAULT_MAX_PENDING_HANDSHAKES,
            bind_ip: None,
            unacked_timeout: Some(Duration::from_secs(2)),
        }
    }
}

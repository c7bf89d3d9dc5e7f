//! How Warren's nodes talk to each other.
//!
//! The traits here are the only thing the layers above (GM rings, the
//! metadata store, queue forwarding) see of the network; TCP, QUIC and the
//! in-memory [`mem`] transport are interchangeable behind them. A node's
//! services share its one peer port through [`mux`].
//!
//! # The contract every transport keeps
//!
//! - A [`Connection`] is authenticated: both ends ran the cluster handshake
//!   ([`warren_wire::handshake`]) and know each other's [`NodeName`].
//! - Frames arrive whole, in the order they were sent on their lane, at most
//!   once. [`FrameSender::feed`] sends on lane 0; a transport may let a
//!   frame of another lane ([`FrameSender::feed_lane`]) overtake a long one
//!   still on its way (the byte-stream transports do, for frames over one
//!   chunk, [`TransportConfig::chunk_len`]), or keep every frame in order.
//! - Any error, or `Ok(None)` from `recv`, means the connection is down; frames
//!   in flight at that moment may be lost. Callers reconnect.
//! - No wait is unbounded: connecting and the handshake time out, and a
//!   TCP connection whose data the peer's network stack does not
//!   acknowledge fails ([`TransportConfig::unacked_timeout`]).
//! - Before the handshake, a peer can make a listener hold little: byte-stream
//!   transports refuse frames over [`HANDSHAKE_MAX_FRAME_LEN`]
//!   until the peer has proven the secret ([`stream::establish`]), and a
//!   listener authenticates at most [`TransportConfig::max_pending_handshakes`]
//!   connections at once, closing the others ([`HandshakeSlots`]).
//! - Frames over the configured maximum ([`TransportConfig::max_frame_len`],
//!   257 MiB by default) are refused: locally when feeding
//!   ([`TransportError::FrameTooLarge`]) and by a receiver whose maximum is
//!   smaller (the connection is then closed). Byte-stream transports carry a
//!   frame over one chunk (16 MiB by default) in pieces that the receiver
//!   joins ([`warren_wire::frame`]); memory stays bounded by the maximum.
//!
//! # Batching
//!
//! [`FrameSender::feed`] only buffers; [`FrameSender::flush`] writes every
//! buffered frame in as few writes as possible. Feed everything produced in one
//! turn of an event loop, then flush once: that is what makes small frames cheap.
//! [`FrameSender::flush_some`] writes at most one piece of a long frame, so
//! that a writer can feed frames of other lanes between its pieces.

mod config;
#[cfg(feature = "conformance")]
pub mod conformance;
mod error;
mod handshake;
mod listener;
pub mod mem;
pub mod mux;
mod slots;
pub mod stream;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use bytes::Bytes;

pub use config::{PeerAddr, TransportConfig};
pub use error::TransportError;
pub use handshake::run_handshake;
pub use listener::ChannelListener;
pub use slots::{HandshakeSlot, HandshakeSlots};
pub use warren_wire::{ClusterSecret, HANDSHAKE_MAX_FRAME_LEN, MAX_CHUNK_LEN, NodeName, Role};

/// A way to reach other nodes: listen for them and dial them.
#[async_trait]
pub trait Transport: Send + Sync + fmt::Debug + 'static {
    /// A short name for logs and bench tables (`"tcp"`, `"quic"`, `"mem"`).
    fn kind(&self) -> &'static str;

    /// Starts accepting peers at `addr`.
    async fn listen(&self, addr: &PeerAddr) -> Result<Box<dyn Listener>, TransportError>;

    /// Dials the peer at `addr` and runs the handshake; bounded by the
    /// configured connect and handshake timeouts.
    async fn connect(&self, addr: &PeerAddr) -> Result<Connection, TransportError>;

    /// Whether no process listens at `addr` any more: true only on a
    /// definite sign (the peer's host refused), false when unsure. Transports
    /// whose connections do not close when the peer's process dies (QUIC over
    /// UDP) answer it, so that the failure detector sees a SIGKILLed node at
    /// once, as TCP's refused dials show it; the others keep this default.
    async fn refuses(&self, _addr: &PeerAddr) -> bool {
        false
    }
}

/// Accepts authenticated connections from peers.
///
/// Handshakes run in the background; peers that fail them (wrong secret,
/// wrong version, garbage) are logged and never returned from `accept`.
#[async_trait]
pub trait Listener: Send + fmt::Debug {
    /// The address peers dial to reach this listener.
    fn local_addr(&self) -> PeerAddr;

    /// The next authenticated connection.
    async fn accept(&mut self) -> Result<Connection, TransportError>;
}

/// The sending half of a connection.
#[async_trait]
pub trait FrameSender: Send + fmt::Debug {
    /// Buffers one frame on lane 0. Never blocks; refuses a frame over the
    /// maximum size.
    fn feed(&mut self, frame: Bytes) -> Result<(), TransportError>;

    /// Buffers one frame on `lane`: it arrives after the frames fed before
    /// it on that lane, and may arrive before those of other lanes.
    fn feed_lane(&mut self, _lane: u64, frame: Bytes) -> Result<(), TransportError> {
        self.feed(frame)
    }

    /// Bytes buffered by `feed` and not yet flushed.
    fn buffered(&self) -> usize;

    /// Writes every buffered frame; returns when the transport has taken them.
    async fn flush(&mut self) -> Result<(), TransportError>;

    /// Writes the buffered frames but, of a frame in pieces, at most one
    /// piece: returns with the rest of it still [`buffered`](Self::buffered),
    /// so that frames fed before the next call can go between its pieces.
    async fn flush_some(&mut self) -> Result<(), TransportError> {
        self.flush().await
    }

    /// Flushes, then tells the peer no more frames follow.
    async fn close(&mut self) -> Result<(), TransportError>;
}

/// The receiving half of a connection.
#[async_trait]
pub trait FrameReceiver: Send + fmt::Debug {
    /// The next frame; `Ok(None)` when the peer closed the connection cleanly.
    async fn recv(&mut self) -> Result<Option<Bytes>, TransportError>;

    /// Waits for at least one frame, then appends every frame already
    /// received (up to `max`) to `out`. Returns how many were appended;
    /// `0` means the peer closed cleanly.
    async fn recv_batch(
        &mut self,
        out: &mut Vec<Bytes>,
        max: usize,
    ) -> Result<usize, TransportError>;
}

/// An authenticated connection to one peer node: an ordered, reliable-until-error
/// stream of whole frames in each direction.
pub struct Connection {
    peer: NodeName,
    sender: Box<dyn FrameSender>,
    receiver: Box<dyn FrameReceiver>,
    /// Set by a transport that can move the connection's socket to the
    /// runtime that polls it next ([`Connection::follow_next_poller`]).
    move_flag: Option<Arc<AtomicBool>>,
}

impl Connection {
    /// Wraps the two halves of an authenticated connection to `peer`.
    pub fn new(
        peer: NodeName,
        sender: Box<dyn FrameSender>,
        receiver: Box<dyn FrameReceiver>,
    ) -> Self {
        Self {
            peer,
            sender,
            receiver,
            move_flag: None,
        }
    }

    /// A connection whose socket moves to the runtime that polls it next
    /// once `flag` is set (the transport's socket reads it before each use).
    #[must_use]
    pub fn with_move_flag(mut self, flag: Arc<AtomicBool>) -> Self {
        self.move_flag = Some(flag);
        self
    }

    /// Asks the transport to drive this connection's socket on the tokio
    /// runtime that polls it next, where it can: a listener on one runtime
    /// hands it to a service on another, whose reads then wake that
    /// service's threads instead of crossing from the listener's (a wake
    /// between threads costs tens of microseconds a read). Transports that
    /// cannot move their sockets ignore it.
    pub fn follow_next_poller(&self) {
        if let Some(flag) = &self.move_flag {
            flag.store(true, Ordering::Release);
        }
    }

    /// The peer's node name, as proven in the handshake.
    pub fn peer_node(&self) -> &NodeName {
        &self.peer
    }

    /// Buffers one frame (see [`FrameSender::feed`]).
    pub fn feed(&mut self, frame: Bytes) -> Result<(), TransportError> {
        self.sender.feed(frame)
    }

    /// Writes the buffered frames (see [`FrameSender::flush`]).
    pub async fn flush(&mut self) -> Result<(), TransportError> {
        self.sender.flush().await
    }

    /// Feeds and flushes one frame.
    pub async fn send(&mut self, frame: Bytes) -> Result<(), TransportError> {
        self.sender.feed(frame)?;
        self.sender.flush().await
    }

    /// The next frame (see [`FrameReceiver::recv`]).
    pub async fn recv(&mut self) -> Result<Option<Bytes>, TransportError> {
        self.receiver.recv().await
    }

    /// A batch of frames (see [`FrameReceiver::recv_batch`]).
    pub async fn recv_batch(
        &mut self,
        out: &mut Vec<Bytes>,
        max: usize,
    ) -> Result<usize, TransportError> {
        self.receiver.recv_batch(out, max).await
    }

    /// Flushes and closes the sending side.
    pub async fn close(&mut self) -> Result<(), TransportError> {
        self.sender.close().await
    }

    /// Splits into halves that separate tasks can own.
    pub fn split(self) -> (Box<dyn FrameSender>, Box<dyn FrameReceiver>) {
        (self.sender, self.receiver)
    }
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

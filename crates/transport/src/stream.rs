//! Frame halves over any ordered byte stream (TCP, TLS, a QUIC stream).
//!
//! The sender copies fed frames into one buffer and writes it with as few
//! syscalls as possible; the receiver reads up to [`READ_CHUNK`] bytes per
//! syscall and splits out every whole frame. [`establish`] runs the cluster
//! handshake over a stream's halves with the receiver held to
//! [`HANDSHAKE_MAX_FRAME_LEN`] until the peer has proven the secret.

use std::fmt;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use warren_wire::{FrameDecoder, HANDSHAKE_MAX_FRAME_LEN, encode_frame};

use crate::{
    Connection, FrameReceiver, FrameSender, PeerAddr, Role, TransportConfig, TransportError,
    run_handshake,
};

/// How many bytes the receiver asks the OS for at once.
pub const READ_CHUNK: usize = 64 * 1024;

/// Something to run when a sender closes (e.g. finishing a QUIC stream).
pub type CloseHook<W> = fn(&mut W) -> std::io::Result<()>;

/// The sending half of a framed byte stream.
pub struct StreamSender<W> {
    writer: W,
    buf: BytesMut,
    max_frame_len: usize,
    peer: String,
    broken: bool,
}

impl<W: AsyncWrite + Unpin + Send> StreamSender<W> {
    /// Frames for `peer` written to `writer`, refusing frames over `max_frame_len`.
    pub fn new(writer: W, max_frame_len: usize, peer: impl Into<String>) -> Self {
        Self {
            writer,
            buf: BytesMut::with_capacity(READ_CHUNK),
            max_frame_len,
            peer: peer.into(),
            broken: false,
        }
    }

    /// Names the peer in later errors (once the handshake has told us who it is).
    pub fn set_peer(&mut self, peer: impl Into<String>) {
        self.peer = peer.into();
    }

    fn lost(&mut self, e: &std::io::Error) -> TransportError {
        self.broken = true;
        TransportError::lost(self.peer.clone(), e)
    }
}

impl<W> fmt::Debug for StreamSender<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamSender")
            .field("peer", &self.peer)
            .field("buffered", &self.buf.len())
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl<W: AsyncWrite + Unpin + Send> FrameSender for StreamSender<W> {
    fn feed(&mut self, frame: Bytes) -> Result<(), TransportError> {
        if self.broken {
            return Err(TransportError::ConnectionLost {
                peer: self.peer.clone(),
                reason: "an earlier write failed".into(),
            });
        }
        encode_frame(&frame, self.max_frame_len, &mut self.buf)
            .map_err(TransportError::FrameTooLarge)
    }

    fn buffered(&self) -> usize {
        self.buf.len()
    }

    async fn flush(&mut self) -> Result<(), TransportError> {
        if !self.buf.is_empty() {
            if let Err(e) = self.writer.write_all(&self.buf).await {
                return Err(self.lost(&e));
            }
            self.buf.clear();
        }
        if let Err(e) = self.writer.flush().await {
            return Err(self.lost(&e));
        }
        Ok(())
    }

    async fn close(&mut self) -> Result<(), TransportError> {
        self.flush().await?;
        if let Err(e) = self.writer.shutdown().await {
            return Err(self.lost(&e));
        }
        Ok(())
    }
}

/// The receiving half of a framed byte stream.
pub struct StreamReceiver<R> {
    reader: R,
    buf: BytesMut,
    decoder: FrameDecoder,
    peer: String,
}

impl<R: AsyncRead + Unpin + Send> StreamReceiver<R> {
    /// Frames from `peer` read from `reader`, refusing frames over `max_frame_len`.
    pub fn new(reader: R, max_frame_len: usize, peer: impl Into<String>) -> Self {
        Self {
            reader,
            buf: BytesMut::with_capacity(READ_CHUNK),
            decoder: FrameDecoder::new(max_frame_len),
            peer: peer.into(),
        }
    }

    /// Names the peer in later errors.
    pub fn set_peer(&mut self, peer: impl Into<String>) {
        self.peer = peer.into();
    }

    /// Refuses frames over `max_frame_len` from now on.
    pub fn set_max_frame_len(&mut self, max_frame_len: usize) {
        self.decoder = FrameDecoder::new(max_frame_len);
    }

    fn decode(&mut self) -> Result<Option<Bytes>, TransportError> {
        self.decoder.decode(&mut self.buf).map_err(|e| {
            tracing::warn!(peer = %self.peer, error = %e, "refusing frame from peer; closing connection");
            TransportError::FrameTooLarge(e)
        })
    }

    /// Reads more bytes; `Ok(false)` on a clean end of stream between frames.
    async fn fill(&mut self) -> Result<bool, TransportError> {
        if self.buf.capacity() - self.buf.len() < READ_CHUNK / 4 {
            self.buf.reserve(READ_CHUNK);
        }
        match self.reader.read_buf(&mut self.buf).await {
            Ok(0) if self.buf.is_empty() => Ok(false),
            Ok(0) => Err(TransportError::ConnectionLost {
                peer: self.peer.clone(),
                reason: format!(
                    "stream ended inside a frame ({} bytes pending)",
                    self.buf.len()
                ),
            }),
            Ok(_) => Ok(true),
            Err(e) => Err(TransportError::lost(self.peer.clone(), &e)),
        }
    }
}

impl<R> fmt::Debug for StreamReceiver<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamReceiver")
            .field("peer", &self.peer)
            .field("buffered", &self.buf.len())
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl<R: AsyncRead + Unpin + Send> FrameReceiver for StreamReceiver<R> {
    async fn recv(&mut self) -> Result<Option<Bytes>, TransportError> {
        loop {
            if let Some(frame) = self.decode()? {
                return Ok(Some(frame));
            }
            if !self.fill().await? {
                return Ok(None);
            }
        }
    }

    async fn recv_batch(
        &mut self,
        out: &mut Vec<Bytes>,
        max: usize,
    ) -> Result<usize, TransportError> {
        let mut n = 0;
        loop {
            while n < max {
                match self.decode()? {
                    Some(frame) => {
                        out.push(frame);
                        n += 1;
                    }
                    None => break,
                }
            }
            if n > 0 || max == 0 {
                return Ok(n);
            }
            if !self.fill().await? {
                return Ok(0);
            }
        }
    }
}

/// Runs the cluster handshake as `role` over the halves of a fresh byte
/// stream from `addr` and wraps them as a [`Connection`] to the proven peer.
///
/// Until the peer has proven the cluster secret its frames may be at most
/// [`HANDSHAKE_MAX_FRAME_LEN`] bytes (a longer announcement closes the
/// connection before anything of it is buffered); the configured maximum
/// applies after.
pub async fn establish<R, W>(
    read: R,
    write: W,
    config: &TransportConfig,
    role: Role,
    addr: &PeerAddr,
) -> Result<Connection, TransportError>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let mut sender = StreamSender::new(write, config.max_frame_len, addr.to_string());
    let pre_auth = HANDSHAKE_MAX_FRAME_LEN.min(config.max_frame_len);
    let mut receiver = StreamReceiver::new(read, pre_auth, addr.to_string());
    let peer = run_handshake(&mut sender, &mut receiver, config, role, addr).await?;
    receiver.set_max_frame_len(config.max_frame_len);
    sender.set_peer(peer.to_string());
    receiver.set_peer(peer.to_string());
    Ok(Connection::new(peer, Box::new(sender), Box::new(receiver)))
}

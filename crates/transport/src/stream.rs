//! Frame halves over any ordered byte stream (TCP, TLS, a QUIC stream).
//!
//! The sender copies fed frames into one buffer and writes it with as few
//! syscalls as possible; a frame over one chunk ([`TransportConfig::chunk_len`])
//! goes in pieces written straight from the frame, and frames of other lanes
//! fed meanwhile go between them ([`FrameEncoder`]). The receiver reads up
//! to [`READ_CHUNK`] bytes per syscall, splits out every whole frame and
//! joins split ones. [`establish`] runs the cluster handshake over a
//! stream's halves with the receiver held to [`HANDSHAKE_MAX_FRAME_LEN`]
//! until the peer has proven the secret.

use std::fmt;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use warren_wire::{FrameDecoder, FrameEncoder, HANDSHAKE_MAX_FRAME_LEN, WireError};

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
    encoder: FrameEncoder,
    peer: String,
    broken: bool,
}

impl<W: AsyncWrite + Unpin + Send> StreamSender<W> {
    /// Frames for `peer` written to `writer`, refusing frames over
    /// `config.max_frame_len` and splitting those over `config.chunk_len`.
    pub fn new(writer: W, config: &TransportConfig, peer: impl Into<String>) -> Self {
        Self {
            writer,
            encoder: FrameEncoder::new(config.chunk_len, config.max_frame_len, READ_CHUNK),
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

    /// Writes the whole frames that may go now and, if a split frame is in
    /// progress, its next piece; returns whether one was written.
    async fn write_piece(&mut self) -> Result<bool, TransportError> {
        let piece = self.encoder.next_piece();
        if !self.encoder.head().is_empty() {
            if let Err(e) = self.writer.write_all(self.encoder.head()).await {
                return Err(self.lost(&e));
            }
            self.encoder.clear_head();
        }
        let Some(piece) = piece else {
            return Ok(false);
        };
        if let Err(e) = self.writer.write_all(&piece).await {
            return Err(self.lost(&e));
        }
        Ok(true)
    }

    async fn flush_writer(&mut self) -> Result<(), TransportError> {
        if let Err(e) = self.writer.flush().await {
            return Err(self.lost(&e));
        }
        Ok(())
    }
}

impl<W> fmt::Debug for StreamSender<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamSender")
            .field("peer", &self.peer)
            .field("buffered", &self.encoder.pending())
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl<W: AsyncWrite + Unpin + Send> FrameSender for StreamSender<W> {
    fn feed(&mut self, frame: Bytes) -> Result<(), TransportError> {
        self.feed_lane(0, frame)
    }

    fn feed_lane(&mut self, lane: u64, frame: Bytes) -> Result<(), TransportError> {
        if self.broken {
            return Err(TransportError::ConnectionLost {
                peer: self.peer.clone(),
                reason: "an earlier write failed".into(),
            });
        }
        self.encoder
            .push(lane, frame)
            .map_err(TransportError::FrameTooLarge)
    }

    fn buffered(&self) -> usize {
        self.encoder.pending()
    }

    async fn flush(&mut self) -> Result<(), TransportError> {
        while self.write_piece().await? {}
        self.flush_writer().await
    }

    async fn flush_some(&mut self) -> Result<(), TransportError> {
        self.write_piece().await?;
        self.flush_writer().await
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
    /// Frames from `peer` read from `reader`, refusing frames over
    /// `max_frame_len` (and pieces over that or 16 MiB).
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
        self.decoder.set_max_frame_len(max_frame_len);
    }

    fn decode(&mut self) -> Result<Option<Bytes>, TransportError> {
        self.decoder.decode(&mut self.buf).map_err(|e| {
            tracing::warn!(peer = %self.peer, error = %e, "refusing frame from peer; closing connection");
            match e {
                WireError::FrameTooLarge { .. } => TransportError::FrameTooLarge(e),
                _ => TransportError::Malformed(e),
            }
        })
    }

    /// Reads more bytes; `Ok(false)` on a clean end of stream between frames.
    async fn fill(&mut self) -> Result<bool, TransportError> {
        if self.buf.capacity() - self.buf.len() < READ_CHUNK / 4 {
            self.buf.reserve(READ_CHUNK);
        }
        match self.reader.read_buf(&mut self.buf).await {
            Ok(0) if self.buf.is_empty() && self.decoder.joining() == 0 => Ok(false),
            Ok(0) => Err(TransportError::ConnectionLost {
                peer: self.peer.clone(),
                reason: format!(
                    "stream ended inside a frame ({} bytes pending)",
                    self.buf.len() + self.decoder.joining()
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
    let mut sender = StreamSender::new(write, config, addr.to_string());
    let pre_auth = HANDSHAKE_MAX_FRAME_LEN.min(config.max_frame_len);
    let mut receiver = StreamReceiver::new(read, pre_auth, addr.to_string());
    let peer = run_handshake(&mut sender, &mut receiver, config, role, addr).await?;
    receiver.set_max_frame_len(config.max_frame_len);
    sender.set_peer(peer.to_string());
    receiver.set_peer(peer.to_string());
    Ok(Connection::new(peer, Box::new(sender), Box::new(receiver)))
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncWriteExt as _, DuplexStream, duplex};
    use warren_wire::{ClusterSecret, NodeName};

    use super::*;

    fn config(chunk_len: usize, max_frame_len: usize) -> TransportConfig {
        let mut c = TransportConfig::new(
            NodeName::new("test@stream").expect("a valid name"),
            ClusterSecret::new("s"),
        );
        c.chunk_len = chunk_len;
        c.max_frame_len = max_frame_len;
        c
    }

    fn halves(
        chunk_len: usize,
        max_frame_len: usize,
    ) -> (StreamSender<DuplexStream>, StreamReceiver<DuplexStream>) {
        let (a, b) = duplex(1 << 20);
        (
            StreamSender::new(a, &config(chunk_len, max_frame_len), "b"),
            StreamReceiver::new(b, max_frame_len, "a"),
        )
    }

    #[tokio::test]
    async fn a_frame_of_another_lane_overtakes_a_long_one_and_its_own_lane_waits() {
        let (mut tx, mut rx) = halves(64, 4096);
        let long = Bytes::from(vec![7u8; 1000]);
        tx.feed_lane(1, long.clone()).unwrap();
        tx.feed_lane(1, Bytes::from_static(b"after")).unwrap();
        tx.flush_some().await.unwrap();
        assert!(tx.buffered() > 0, "one piece written, the rest waits");
        tx.feed_lane(2, Bytes::from_static(b"other")).unwrap();
        tx.flush().await.unwrap();
        assert_eq!(tx.buffered(), 0);
        let mut got = Vec::new();
        while got.len() < 3 {
            got.push(rx.recv().await.unwrap().unwrap());
        }
        assert_eq!(
            got,
            [
                Bytes::from_static(b"other"),
                long,
                Bytes::from_static(b"after")
            ]
        );
    }

    #[tokio::test]
    async fn a_stream_that_ends_inside_a_split_frame_is_lost() {
        let (a, b) = duplex(1 << 20);
        let mut tx = StreamSender::new(a, &config(64, 4096), "b");
        let mut rx = StreamReceiver::new(b, 4096, "a");
        tx.feed(Bytes::from(vec![1u8; 1000])).unwrap();
        tx.flush_some().await.unwrap();
        // The writer goes away after the first piece.
        tx.writer.shutdown().await.unwrap();
        let err = rx.recv().await.expect_err("a frame cut short");
        assert!(err.to_string().contains("inside a frame"), "{err}");
    }

    #[tokio::test]
    async fn a_split_frame_over_the_maximum_is_refused_at_its_first_bytes() {
        let (mut a, b) = duplex(1 << 20);
        let mut rx = StreamReceiver::new(b, 4096, "a");
        // A first piece of 8 bytes announcing 4097, and nothing more.
        a.write_all(&[0x80, 0, 0, 8, 0, 0, 0x10, 0x01])
            .await
            .unwrap();
        let err = rx.recv().await.expect_err("over the maximum");
        assert!(matches!(err, TransportError::FrameTooLarge(_)), "{err:?}");
        // Pieces out of sequence are refused as malformed.
        let (mut a, b) = duplex(1 << 20);
        let mut rx = StreamReceiver::new(b, 4096, "a");
        a.write_all(&[0x40, 0, 0, 1, 9]).await.unwrap();
        let err = rx.recv().await.expect_err("a next piece first");
        assert!(matches!(err, TransportError::Malformed(_)), "{err:?}");
    }
}

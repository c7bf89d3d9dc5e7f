//! A TCP stream that can move to another tokio runtime.
//!
//! A tokio socket belongs to the I/O driver of the runtime it was
//! registered on: each time it becomes readable, a thread of that runtime
//! wakes and passes the news to the task that reads it, on whatever runtime
//! that task runs. The node's peer port accepts on the cluster's runtime but
//! the queue rings and forwarding links read on the broker's, so every
//! frame they received cost a wake between threads. [`Movable`] leaves its
//! driver when its flag is set and joins the driver of the runtime that
//! polls it next.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// Where the socket is registered.
enum Socket {
    /// With the driver of the runtime that last polled it.
    Tokio(TcpStream),
    /// With none: it joins the next poller's.
    Std(std::net::TcpStream),
    /// Lost to a failed move.
    Gone,
}

/// A TCP stream that moves to the runtime that polls it next once its flag
/// is set ([`warren_transport::Connection::follow_next_poller`]).
pub(crate) struct Movable {
    socket: Socket,
    flag: Arc<AtomicBool>,
}

impl Movable {
    /// `stream`, moving when `flag` is set.
    pub(crate) fn new(stream: TcpStream, flag: Arc<AtomicBool>) -> Self {
        Self {
            socket: Socket::Tokio(stream),
            flag,
        }
    }

    /// The registered stream, moved first if asked (this must run inside a
    /// runtime: it does, in a poll).
    fn stream(&mut self) -> io::Result<Pin<&mut TcpStream>> {
        // A plain load first: the flag is set once in a connection's life.
        if self.flag.load(Ordering::Relaxed) && self.flag.swap(false, Ordering::AcqRel) {
            self.socket = match std::mem::replace(&mut self.socket, Socket::Gone) {
                Socket::Tokio(s) => Socket::Std(s.into_std()?),
                other => other,
            };
        }
        if matches!(self.socket, Socket::Std(_)) {
            self.socket = match std::mem::replace(&mut self.socket, Socket::Gone) {
                Socket::Std(s) => Socket::Tokio(TcpStream::from_std(s)?),
                other => other,
            };
        }
        match &mut self.socket {
            Socket::Tokio(s) => Ok(Pin::new(s)),
            Socket::Std(_) | Socket::Gone => Err(io::Error::other(
                "the socket was lost moving between runtimes",
            )),
        }
    }
}

impl AsyncRead for Movable {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut().stream() {
            Ok(s) => s.poll_read(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

impl AsyncWrite for Movable {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut().stream() {
            Ok(s) => s.poll_write(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut().stream() {
            Ok(s) => s.poll_write_vectored(cx, bufs),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().stream() {
            Ok(s) => s.poll_flush(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().stream() {
            Ok(s) => s.poll_shutdown(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

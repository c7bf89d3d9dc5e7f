//! The shell around one AMQP client connection: read, feed the broker under
//! its lock, write everything the turn produced in one write.
//!
//! While the broker pauses a connection's input (flow control, a resource
//! alarm), the shell still reads ahead into a bounded buffer without feeding
//! it, so that the client's heartbeats keep it alive and its EOF ends it;
//! with that buffer full, it probes the socket for a peer that has hung up
//! (a FIN behind unread data). A blocked client that goes away is gone at
//! once, with everything it held.

use std::future::Future;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{BufMut as _, BytesMut};
use rustix::event::{PollFd, PollFlags, Timespec, poll};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use warren_broker::{Broker, ConnId, Departed};

use crate::shards::Shards;
use crate::sockets::HeldSocket;
use crate::{lock, now_ms};

/// Bytes a paused connection may read ahead without feeding them: room for
/// its heartbeats and its EOF, little enough that a held publisher cannot
/// grow the node's memory.
const HELD_INPUT_MAX: usize = 256 * 1024;

/// The most one read takes off the socket. `BytesMut` grows by doubling,
/// so without a bound a read into a grown buffer could take megabytes, all
/// fed to the broker at once when the connection resumes: a held publisher
/// of small messages then slipped tens of thousands of them past flow
/// control in one turn (RabbitMQ's Java client, 16 B messages into a
/// mirrored queue: its ring's backlog reached 116k publishes, not 4,000).
const READ_MAX: usize = 64 * 1024;

/// How often a paused connection whose read-ahead is full is probed for a
/// peer that has hung up.
const GONE_PROBE_EVERY: Duration = Duration::from_millis(250);

/// A client's byte stream (plain TCP, TLS over it, or a stream inside the
/// process), which a paused connection probes for a peer that has hung up,
/// and which follows its connection to another shard's thread.
pub(crate) trait ClientStream:
    AsyncRead + AsyncWrite + Unpin + Send + Sized + 'static
{
    /// The stream between two threads' runtimes.
    type Away: Send + 'static;
    /// Whether the peer has hung up, even with data of its still unread.
    fn hung_up(&self) -> bool;
    /// The TLS version it speaks (RabbitMQ's name: `tlsv1.3`); None for
    /// a stream without TLS.
    fn tls_version(&self) -> Option<&'static str> {
        None
    }
    /// Takes the stream off this thread's runtime, to go to another's.
    fn unhome(self) -> Unhomed<Self>;
    /// The stream registered with the calling thread's runtime.
    fn rehome(away: Self::Away) -> std::io::Result<Self>;
}

/// What [`ClientStream::unhome`] gives.
pub(crate) enum Unhomed<S: ClientStream> {
    /// Free to go to another runtime.
    Away(S::Away),
    /// Its socket failed.
    Lost,
}

impl ClientStream for TcpStream {
    type Away = std::net::TcpStream;

    fn hung_up(&self) -> bool {
        peer_gone(self)
    }

    fn unhome(self) -> Unhomed<Self> {
        self.into_std().map_or(Unhomed::Lost, Unhomed::Away)
    }

    fn rehome(away: Self::Away) -> std::io::Result<Self> {
        Self::from_std(away)
    }
}

/// An AMQPS client's socket under its TLS state. The socket alone is bound
/// to a runtime: when its connection moves to another shard's thread it is
/// taken out, and put back there, while the TLS state goes along as it is.
pub(crate) struct TlsSocket(Option<TcpStream>);

impl TlsSocket {
    /// Wraps an accepted socket.
    pub(crate) fn new(s: TcpStream) -> Self {
        Self(Some(s))
    }

    /// Polls `f` on the socket; the error of one taken out to move.
    fn poll_with<T>(
        self: Pin<&mut Self>,
        f: impl FnOnce(Pin<&mut TcpStream>) -> Poll<std::io::Result<T>>,
    ) -> Poll<std::io::Result<T>> {
        match self.get_mut().0.as_mut() {
            Some(s) => f(Pin::new(s)),
            None => Poll::Ready(Err(std::io::ErrorKind::NotConnected.into())),
        }
    }
}

impl AsyncRead for TlsSocket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.poll_with(|s| s.poll_read(cx, buf))
    }
}

impl AsyncWrite for TlsSocket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.poll_with(|s| s.poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.poll_with(|s| s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.poll_with(|s| s.poll_shutdown(cx))
    }
}

/// An AMQPS client: its TLS state goes to another runtime with its socket
/// taken out of it, and gets it back there.
impl ClientStream for tokio_rustls::server::TlsStream<TlsSocket> {
    type Away = (Self, std::net::TcpStream);

    fn hung_up(&self) -> bool {
        self.get_ref().0.0.as_ref().is_some_and(peer_gone)
    }

    fn tls_version(&self) -> Option<&'static str> {
        Some(match self.get_ref().1.protocol_version() {
            Some(rustls::ProtocolVersion::TLSv1_2) => "tlsv1.2",
            Some(rustls::ProtocolVersion::TLSv1_3) => "tlsv1.3",
            _ => "tls",
        })
    }

    fn unhome(mut self) -> Unhomed<Self> {
        let Some(socket) = self.get_mut().0.0.take() else {
            return Unhomed::Lost;
        };
        socket
            .into_std()
            .map_or(Unhomed::Lost, |s| Unhomed::Away((self, s)))
    }

    fn rehome((mut tls, socket): Self::Away) -> std::io::Result<Self> {
        tls.get_mut().0.0 = Some(TcpStream::from_std(socket)?);
        Ok(tls)
    }
}

/// A client inside the process (`shards::InProcess`): its end is seen when
/// the stream ends; it belongs to no runtime.
impl ClientStream for tokio::io::DuplexStream {
    type Away = Self;

    fn hung_up(&self) -> bool {
        false
    }

    fn unhome(self) -> Unhomed<Self> {
        Unhomed::Away(self)
    }

    fn rehome(away: Self::Away) -> std::io::Result<Self> {
        Ok(away)
    }
}

/// Whether the peer of the socket `fd` has hung up (closed or shut down its
/// sending side), even with data of its still unread.
fn peer_gone(fd: &impl AsFd) -> bool {
    let mut fds = [PollFd::new(fd, PollFlags::RDHUP)];
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(poll(&mut fds, Some(&now)), Ok(n) if n > 0)
        && fds[0]
            .revents()
            .intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR)
}

/// Connection `id`'s timer deadline and whether its input is paused, read
/// under the lock its turn already holds.
fn turn_state(b: &Broker, id: ConnId) -> (Option<u64>, bool) {
    (b.poll_conn_timeout(id), b.input_paused(id))
}

/// Reads what `stream` has into `input`, at most [`READ_MAX`] bytes.
async fn read_some<S: AsyncRead + Unpin>(
    stream: &mut S,
    input: &mut BytesMut,
) -> std::io::Result<usize> {
    stream.read_buf(&mut input.limit(READ_MAX)).await
}

/// Runs one client connection over TCP, or TLS for AMQPS. `socket`, its
/// share of the node's client sockets, is given back when it ends.
pub(crate) async fn serve(
    shards: Shards,
    k: usize,
    stream: impl ClientStream,
    peer: SocketAddr,
    running: Arc<AtomicBool>,
    socket: HeldSocket,
) {
    let notify = Arc::new(Notify::new());
    let id = {
        let n = notify.clone();
        let mut b = lock(&shards.all()[k]);
        // Checked under the broker lock: `stop_app` clears it before its
        // `close_all`, so a client accepted just before is closed either way.
        if !running.load(Ordering::SeqCst) {
            return;
        }
        let id = b.connect(peer, Arc::new(move || n.notify_one()));
        if let Some(version) = stream.tls_version() {
            b.set_tls(id, version);
        }
        // Its first queue may be another shard's: this shell moves it.
        b.may_move(id);
        id
    };
    let session = Session {
        k,
        id,
        input: BytesMut::with_capacity(64 * 1024),
        notify,
        _socket: socket,
    };
    run(shards, stream, session).await;
}

/// A client connection's state between two turns, which goes with it to
/// another shard's thread.
struct Session {
    /// Its shard.
    k: usize,
    id: ConnId,
    /// Bytes read and not yet fed to the broker.
    input: BytesMut,
    /// Woken when another connection's work left output for it.
    notify: Arc<Notify>,
    _socket: HeldSocket,
}

/// Serves `session` over `stream` until it ends; a connection that moves
/// to another shard (`Broker::moving`) goes on on that shard's thread.
fn run<S: ClientStream>(
    shards: Shards,
    mut stream: S,
    session: Session,
) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    Box::pin(async move {
        let Session {
            k: first,
            mut id,
            mut input,
            notify,
            _socket,
        } = session;
        let broker = shards.all()[first].clone();
        let mut output = BytesMut::with_capacity(64 * 1024);
        // Bytes wait in `input`, unfed because the connection was paused (or
        // was moving).
        let mut held = !input.is_empty();
        let mut probed = Instant::now();
        // The connection's timer deadline and whether its input is paused, as
        // the last turn under the lock left them (read in that same turn: one
        // lock per turn, not two).
        let (mut deadline, mut paused) = turn_state(&lock(&broker), id);
        loop {
            if held && !paused {
                let mut b = lock(&broker);
                if !b.input_paused(id) {
                    b.handle_input(id, &mut input, now_ms());
                    held = !input.is_empty() && b.input_paused(id);
                }
                (deadline, paused) = turn_state(&b, id);
            }
            let full = paused && input.len() >= HELD_INPUT_MAX;
            if full && probed.elapsed() >= GONE_PROBE_EVERY {
                probed = Instant::now();
                if stream.hung_up() {
                    break;
                }
            }
            let wait = deadline.map(|d| Duration::from_millis(d.saturating_sub(now_ms())));
            if input.capacity() - input.len() < 16 * 1024 {
                input.reserve(64 * 1024);
            }
            // Whether it stays open, and the shard it asks to move to.
            let (open, moving) = {
                let mut b = tokio::select! {
                    // Flow control: a publisher waits while mirrored queues catch up.
                    () = tokio::time::sleep(Duration::from_millis(2)), if paused => {
                        let mut b = lock(&broker);
                        if full {
                            // We are the ones not reading: its silence is ours.
                            b.hold_input(id);
                        }
                        b
                    }
                    r = read_some(&mut stream, &mut input), if !full => match r {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {
                            let mut b = lock(&broker);
                            if b.input_paused(id) {
                                b.hold_input(id);
                            } else {
                                b.handle_input(id, &mut input, now_ms());
                            }
                            // What a paused connection left unread (a resource alarm
                            // stops input after a content frame) is fed once it
                            // resumes, even if nothing more arrives.
                            held = !input.is_empty() && b.input_paused(id);
                            b
                        }
                    },
                    () = notify.notified() => lock(&broker),
                    () = tokio::time::sleep(wait.unwrap_or(Duration::ZERO)), if wait.is_some() => {
                        let mut b = lock(&broker);
                        b.handle_conn_tick(id, now_ms());
                        b
                    }
                };
                let open = b.take_output(id, &mut output);
                (deadline, paused) = turn_state(&b, id);
                (open, b.moving(id))
            };
            if !output.is_empty() {
                // The flush sends what TLS still holds of it: its last records
                // wait there when the socket was not ready for them, until the
                // next write, which may be a heartbeat away.
                if stream.write_all(&output).await.is_err() || stream.flush().await.is_err() {
                    break;
                }
                // Drop our handle so that the encoder can reuse the allocation.
                output = BytesMut::new();
            }
            if !open {
                break;
            }
            // Its first queue is another shard's: it goes there, and its
            // task to that shard's thread.
            if let Some(to) = moving {
                let Some(k) = shards.by_name(&to) else {
                    lock(&broker).stay(id);
                    continue;
                };
                let detached = lock(&broker).detach(id);
                let Some(m) = detached else { continue };
                let target = shards.all()[k].clone();
                let n = notify.clone();
                id = lock(&target).attach(m, Arc::new(move || n.notify_one()), now_ms());
                // What it did there is taken on its next turn.
                notify.notify_one();
                match stream.unhome() {
                    Unhomed::Away(away) => {
                        let session = Session {
                            k,
                            id,
                            input,
                            notify,
                            _socket,
                        };
                        let to = shards.clone();
                        shards.spawn(k, async move {
                            match S::rehome(away) {
                                Ok(stream) => run(to, stream, session).await,
                                Err(e) => {
                                    tracing::warn!(error = %e, "a client's socket could not follow it to its shard");
                                    drop(lock(&to.all()[k]).disconnect(session.id, now_ms()));
                                }
                            }
                        });
                        return;
                    }
                    Unhomed::Lost => {
                        drop(lock(&target).disconnect(id, now_ms()));
                        return;
                    }
                }
            }
        }
        let departed = lock(&broker).disconnect(id, now_ms());
        // Unfinished messages can be large: freed here, off the broker's lock.
        let closed = departed
            .filter(Departed::client_closed)
            .map(Departed::into_amqp);
        if let Some(mut amqp) = closed {
            // After close-ok the socket is the client's to close, as with
            // RabbitMQ: a client may still be writing what it queued behind its
            // connection.close (amqplib's publishes; amqp091-go's concurrent
            // closes, each waiting for its close-ok), and one that reads
            // end-of-file before it has seen its own close through takes it for
            // a lost connection. So it is read to its end (or for a bounded
            // time) before this side is shut.
            let _ = tokio::time::timeout(CLOSED_READ_LIMIT, async {
                loop {
                    amqp.handle_bytes(&mut input);
                    output.clear();
                    amqp.take_output(&mut output);
                    if !output.is_empty()
                        && (stream.write_all(&output).await.is_err()
                            || stream.flush().await.is_err())
                    {
                        return;
                    }
                    input.reserve(16 * 1024);
                    if !matches!(stream.read_buf(&mut input).await, Ok(n) if n > 0) {
                        return;
                    }
                }
            })
            .await;
        }
        let _ = stream.shutdown().await;
    })
}

/// How long a connection the client closed is read to its end, at most,
/// before the server shuts the socket.
const CLOSED_READ_LIMIT: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use super::*;

    /// A buffer grown by a held connection (capacity in megabytes) still
    /// takes at most `READ_MAX` from the socket per read.
    #[tokio::test]
    async fn one_read_takes_at_most_read_max_however_large_the_buffer() {
        let waiting = vec![7u8; 4 * READ_MAX];
        let mut socket: &[u8] = &waiting;
        let mut input = BytesMut::with_capacity(16 * READ_MAX);
        let n = read_some(&mut socket, &mut input).await.expect("read");
        assert_eq!((n, input.len()), (READ_MAX, READ_MAX));
        let n = read_some(&mut socket, &mut input).await.expect("read");
        assert_eq!((n, input.len()), (READ_MAX, 2 * READ_MAX));
    }
}

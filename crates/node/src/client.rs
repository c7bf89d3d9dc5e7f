//! The shell around one AMQP client connection: read, feed the broker under
//! its lock, write everything the turn produced in one write.
//!
//! While the broker pauses a connection's input (flow control, a resource
//! alarm), the shell still reads ahead into a bounded buffer without feeding
//! it, so that the client's heartbeats keep it alive and its EOF ends it;
//! with that buffer full, it probes the socket for a peer that has hung up
//! (a FIN behind unread data). A blocked client that goes away is gone at
//! once, with everything it held.

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use rustix::event::{PollFd, PollFlags, Timespec, poll};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use warren_broker::{Broker, ConnId, Departed};

use crate::sockets::HeldSocket;
use crate::{Shared, lock, now_ms};

/// Bytes a paused connection may read ahead without feeding them: room for
/// its heartbeats and its EOF, little enough that a held publisher cannot
/// grow the node's memory.
const HELD_INPUT_MAX: usize = 256 * 1024;

/// How often a paused connection whose read-ahead is full is probed for a
/// peer that has hung up.
const GONE_PROBE_EVERY: Duration = Duration::from_millis(250);

/// A client's byte stream (plain TCP, TLS over it, or a stream inside the
/// process), which a paused connection probes for a peer that has hung up.
pub(crate) trait ClientStream: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// Whether the peer has hung up, even with data of its still unread.
    fn hung_up(&self) -> bool;
}

impl ClientStream for TcpStream {
    fn hung_up(&self) -> bool {
        peer_gone(self)
    }
}

impl ClientStream for tokio_rustls::server::TlsStream<TcpStream> {
    fn hung_up(&self) -> bool {
        peer_gone(self.get_ref().0)
    }
}

/// A client inside the process (`shards::InProcess`): its end is seen when
/// the stream ends.
impl ClientStream for tokio::io::DuplexStream {
    fn hung_up(&self) -> bool {
        false
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

/// Runs one client connection over TCP, or TLS for AMQPS. `socket`, its
/// share of the node's client sockets, is given back when it ends.
pub(crate) async fn serve(
    broker: Shared,
    mut stream: impl ClientStream,
    peer: SocketAddr,
    running: Arc<AtomicBool>,
    socket: HeldSocket,
) {
    let _socket = socket;
    let notify = Arc::new(Notify::new());
    let id = {
        let n = notify.clone();
        let mut b = lock(&broker);
        // Checked under the broker lock: `stop_app` clears it before its
        // `close_all`, so a client accepted just before is closed either way.
        if !running.load(Ordering::SeqCst) {
            return;
        }
        b.connect(peer, Arc::new(move || n.notify_one()))
    };
    let mut input = BytesMut::with_capacity(64 * 1024);
    let mut output = BytesMut::with_capacity(64 * 1024);
    // Bytes wait in `input`, unfed because the connection was paused.
    let mut held = false;
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
        let open = {
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
                r = stream.read_buf(&mut input), if !full => match r {
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
            open
        };
        if !output.is_empty() {
            if stream.write_all(&output).await.is_err() {
                break;
            }
            // Drop our handle so that the encoder can reuse the allocation.
            output = BytesMut::new();
        }
        if !open {
            break;
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
                if !output.is_empty() && stream.write_all(&output).await.is_err() {
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
}

/// How long a connection the client closed is read to its end, at most,
/// before the server shuts the socket.
const CLOSED_READ_LIMIT: Duration = Duration::from_secs(2);

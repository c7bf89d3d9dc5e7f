//! Warren's AMQP 0-9-1 server side, without I/O.
//!
//! [`Connection`] is one client connection's state machine over the
//! `amq-protocol` codec: bytes in ([`Connection::handle_bytes`]), events out
//! ([`Connection::poll_event`]), answers in (`accept_*`, [`Connection::reply`],
//! [`Connection::send_content`], …), bytes out ([`Connection::take_output`]),
//! time in ([`Connection::handle_tick`]). It does the handshake (protocol
//! header, start/start-ok with PLAIN and AMQPLAIN, tune/tune-ok, open),
//! channels, heartbeats, content assembly and splitting, and raises every
//! protocol error with RabbitMQ's reply codes and texts. Everything about
//! exchanges, queues and messages is the broker's: it gets a typed
//! [`Command`] per method and answers with a [`Reply`].
//!
//! No sockets, no clocks, no tasks: a shell feeds it. One turn of a shell's
//! loop, here with a client that sends only the protocol header:
//!
//! ```
//! use bytes::BytesMut;
//! use warren_amqp::{Config, Connection, Event};
//!
//! let mut conn = Connection::new(Config::default());
//! let mut input = BytesMut::from(&b"AMQP\x00\x00\x09\x01"[..]); // read from the socket
//! let mut output = BytesMut::new();
//! let now_ms = 0; // the shell's monotonic clock
//!
//! conn.handle_bytes(&mut input);
//! while let Some(event) = conn.poll_event() {
//!     match event {
//!         Event::Authenticate(creds) => {
//!             if creds.password == "guest" { conn.accept_login() } else { conn.refuse_login() }
//!         }
//!         Event::OpenVhost { vhost } => {
//!             if vhost == "/" { conn.accept_vhost() }
//!             else { conn.refuse_vhost(warren_amqp::AmqpError::vhost_not_found(&vhost)) }
//!         }
//!         Event::Command { channel, command } => { /* broker work, then conn.reply(..) */ }
//!         Event::Closed(_) => { /* write `output`, then close the socket */ }
//!         _ => {}
//!     }
//! }
//! conn.handle_bytes(&mut input); // input pauses while a login or vhost is pending
//! if let Some(deadline) = conn.poll_timeout() {
//!     if deadline <= now_ms { conn.handle_tick(now_ms) } // else arm a timer
//! }
//! conn.take_output(&mut output); // one write to the socket
//! assert!(output.starts_with(&[1, 0, 0])); // connection.start on channel 0
//! ```

mod command;
mod connection;
mod depth;
mod error;
mod frame;
pub mod fuzz;

pub use command::{Command, Publish, Reply};
pub use connection::{
    ChannelId, CloseReason, Config, Connection, Credentials, Event, FRAME_MIN_SIZE, Mechanism,
};
pub use depth::{MAX_FIELD_DEPTH, TooDeep, decode_properties};
pub use error::{AmqpError, ReplyCode};
pub use frame::ContentMethod;

/// The `amq-protocol` crate this one builds on (method structs, properties,
/// field tables), re-exported so that the broker uses the same version.
pub use amq_protocol;
/// Message properties (`basic` class content header).
pub use amq_protocol::protocol::BasicProperties;

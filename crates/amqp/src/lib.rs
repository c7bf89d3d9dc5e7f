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
//! No sockets, no clocks, no tasks: a shell feeds it.

mod command;
mod connection;
mod error;
mod frame;

pub use command::{Command, Publish, Reply};
pub use connection::{
    ChannelId, CloseReason, Config, Connection, Credentials, Event, FRAME_MIN_SIZE, Mechanism,
};
pub use error::{AmqpError, ReplyCode};
pub use frame::ContentMethod;

/// The `amq-protocol` crate this one builds on (method structs, properties,
/// field tables), re-exported so that the broker uses the same version.
pub use amq_protocol;
/// Message properties (`basic` class content header).
pub use amq_protocol::protocol::BasicProperties;

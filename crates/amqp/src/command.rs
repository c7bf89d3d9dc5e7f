//! Typed channel-level commands from the client and replies to them.

use amq_protocol::protocol::{AMQPClass, BasicProperties, basic, confirm, exchange, queue, tx};
use amq_protocol::types::ShortString;
use bytes::Bytes;

/// A complete `basic.publish`: method, content header and body.
#[derive(Clone, Debug, PartialEq)]
pub struct Publish {
    /// The exchange name (empty for the default exchange).
    pub exchange: ShortString,
    /// The routing key.
    pub routing_key: ShortString,
    /// Return the message with `basic.return` if it is unroutable.
    pub mandatory: bool,
    /// The message properties from the content header.
    pub properties: BasicProperties,
    /// The message body. When it came in one body frame it is a zero-copy
    /// slice of the shell's read buffer, which it keeps alive: copy it
    /// (`Bytes::copy_from_slice`) before keeping it for long.
    pub body: Bytes,
    /// In confirm mode, the publish sequence number to ack or nack
    /// (1, 2, 3… per channel, counted from `confirm.select`).
    pub confirm_seq: Option<u64>,
}

/// A channel-level method the broker above must act on.
///
/// Connection and channel housekeeping (open, close, flow, heartbeats,
/// content assembly, access.request, mode checks of confirm/tx) never shows
/// up here: the state machine does it. Methods with a `nowait` flag expect
/// no reply when it is set.
// `BasicPublish` is the large, hot variant: boxing it would cost an
// allocation per message.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Command {
    /// `exchange.declare`; reply [`Reply::ExchangeDeclareOk`].
    ExchangeDeclare(exchange::Declare),
    /// `exchange.delete`; reply [`Reply::ExchangeDeleteOk`].
    ExchangeDelete(exchange::Delete),
    /// `exchange.bind`; reply [`Reply::ExchangeBindOk`].
    ExchangeBind(exchange::Bind),
    /// `exchange.unbind`; reply [`Reply::ExchangeUnbindOk`].
    ExchangeUnbind(exchange::Unbind),
    /// `queue.declare`; reply [`Reply::QueueDeclareOk`].
    QueueDeclare(queue::Declare),
    /// `queue.bind`; reply [`Reply::QueueBindOk`].
    QueueBind(queue::Bind),
    /// `queue.unbind`; reply [`Reply::QueueUnbindOk`].
    QueueUnbind(queue::Unbind),
    /// `queue.purge`; reply [`Reply::QueuePurgeOk`].
    QueuePurge(queue::Purge),
    /// `queue.delete`; reply [`Reply::QueueDeleteOk`].
    QueueDelete(queue::Delete),
    /// `basic.qos` (prefetch_size is always 0: other values are refused
    /// with 540 as RabbitMQ does); reply [`Reply::BasicQosOk`].
    BasicQos(basic::Qos),
    /// `basic.consume`; reply [`Reply::BasicConsumeOk`].
    BasicConsume(basic::Consume),
    /// `basic.cancel`; reply [`Reply::BasicCancelOk`].
    BasicCancel(basic::Cancel),
    /// A complete `basic.publish` with its content; no reply (confirms
    /// with [`Reply::Ack`] / [`Reply::Nack`] in confirm mode).
    BasicPublish(Publish),
    /// `basic.get`; answer with [`crate::ContentMethod::GetOk`] content or
    /// [`Reply::BasicGetEmpty`].
    BasicGet(basic::Get),
    /// `basic.ack` from a consumer.
    BasicAck(basic::Ack),
    /// `basic.nack` from a consumer.
    BasicNack(basic::Nack),
    /// `basic.reject` from a consumer.
    BasicReject(basic::Reject),
    /// `basic.recover`; reply [`Reply::BasicRecoverOk`].
    BasicRecover(basic::Recover),
    /// `basic.recover-async`; no reply.
    BasicRecoverAsync(basic::RecoverAsync),
    /// `confirm.select`; the channel is in confirm mode from now on;
    /// reply [`Reply::ConfirmSelectOk`] unless nowait.
    ConfirmSelect(confirm::Select),
    /// `tx.select`; reply [`Reply::TxSelectOk`].
    TxSelect,
    /// `tx.commit` on a transactional channel; reply [`Reply::TxCommitOk`].
    TxCommit,
    /// `tx.rollback` on a transactional channel; reply [`Reply::TxRollbackOk`].
    TxRollback,
}

/// A method the broker sends on a channel (replies and server-initiated
/// methods without content).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reply {
    /// `exchange.declare-ok`.
    ExchangeDeclareOk,
    /// `exchange.delete-ok`.
    ExchangeDeleteOk,
    /// `exchange.bind-ok`.
    ExchangeBindOk,
    /// `exchange.unbind-ok`.
    ExchangeUnbindOk,
    /// `queue.declare-ok`.
    QueueDeclareOk {
        /// The queue's name (server-generated when the client sent none).
        queue: String,
        /// Messages ready in the queue.
        message_count: u32,
        /// Consumers on the queue.
        consumer_count: u32,
    },
    /// `queue.bind-ok`.
    QueueBindOk,
    /// `queue.unbind-ok`.
    QueueUnbindOk,
    /// `queue.purge-ok`.
    QueuePurgeOk {
        /// Messages purged.
        message_count: u32,
    },
    /// `queue.delete-ok`.
    QueueDeleteOk {
        /// Messages deleted with the queue.
        message_count: u32,
    },
    /// `basic.qos-ok`.
    BasicQosOk,
    /// `basic.consume-ok`.
    BasicConsumeOk {
        /// The consumer tag (server-generated when the client sent none).
        consumer_tag: String,
    },
    /// `basic.cancel-ok`.
    BasicCancelOk {
        /// The cancelled consumer's tag.
        consumer_tag: String,
    },
    /// `basic.get-empty`.
    BasicGetEmpty,
    /// `basic.recover-ok`.
    BasicRecoverOk,
    /// `basic.ack` confirming publishes (confirm mode).
    Ack {
        /// The publish sequence number.
        delivery_tag: u64,
        /// Whether every number up to and including this one is confirmed.
        multiple: bool,
    },
    /// `basic.nack` refusing publishes (confirm mode).
    Nack {
        /// The publish sequence number.
        delivery_tag: u64,
        /// Whether every number up to and including this one is refused.
        multiple: bool,
    },
    /// `confirm.select-ok`.
    ConfirmSelectOk,
    /// `tx.select-ok`.
    TxSelectOk,
    /// `tx.commit-ok`.
    TxCommitOk,
    /// `tx.rollback-ok`.
    TxRollbackOk,
}

impl Reply {
    /// The `amq-protocol` method this reply encodes to.
    pub(crate) fn into_class(self) -> AMQPClass {
        use AMQPClass as C;
        match self {
            Self::ExchangeDeclareOk => {
                C::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {}))
            }
            Self::ExchangeDeleteOk => {
                C::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {}))
            }
            Self::ExchangeBindOk => C::Exchange(exchange::AMQPMethod::BindOk(exchange::BindOk {})),
            Self::ExchangeUnbindOk => {
                C::Exchange(exchange::AMQPMethod::UnbindOk(exchange::UnbindOk {}))
            }
            Self::QueueDeclareOk {
                queue,
                message_count,
                consumer_count,
            } => C::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                queue: short(queue),
                message_count,
                consumer_count,
            })),
            Self::QueueBindOk => C::Queue(queue::AMQPMethod::BindOk(queue::BindOk {})),
            Self::QueueUnbindOk => C::Queue(queue::AMQPMethod::UnbindOk(queue::UnbindOk {})),
            Self::QueuePurgeOk { message_count } => {
                C::Queue(queue::AMQPMethod::PurgeOk(queue::PurgeOk { message_count }))
            }
            Self::QueueDeleteOk { message_count } => {
                C::Queue(queue::AMQPMethod::DeleteOk(queue::DeleteOk {
                    message_count,
                }))
            }
            Self::BasicQosOk => C::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})),
            Self::BasicConsumeOk { consumer_tag } => {
                C::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                    consumer_tag: short(consumer_tag),
                }))
            }
            Self::BasicCancelOk { consumer_tag } => {
                C::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
                    consumer_tag: short(consumer_tag),
                }))
            }
            Self::BasicGetEmpty => C::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})),
            Self::BasicRecoverOk => C::Basic(basic::AMQPMethod::RecoverOk(basic::RecoverOk {})),
            Self::Ack {
                delivery_tag,
                multiple,
            } => C::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag,
                multiple,
            })),
            Self::Nack {
                delivery_tag,
                multiple,
            } => C::Basic(basic::AMQPMethod::Nack(basic::Nack {
                delivery_tag,
                multiple,
                requeue: false,
            })),
            Self::ConfirmSelectOk => {
                C::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {}))
            }
            Self::TxSelectOk => C::Tx(tx::AMQPMethod::SelectOk(tx::SelectOk {})),
            Self::TxCommitOk => C::Tx(tx::AMQPMethod::CommitOk(tx::CommitOk {})),
            Self::TxRollbackOk => C::Tx(tx::AMQPMethod::RollbackOk(tx::RollbackOk {})),
        }
    }
}

/// A short string from a `String`, cut to 255 bytes.
pub(crate) fn short(mut s: String) -> ShortString {
    crate::error::truncate_short(&mut s);
    ShortString::from(s)
}

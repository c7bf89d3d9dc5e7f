//! The broker driven directly, one responsibility per module, by a client
//! speaking real AMQP 0-9-1 frames (`support`): no `warren` binary, no
//! sockets, no clock. Expected outcomes are RabbitMQ's documented
//! behaviour (reply codes and texts, declare-ok counts, routing rules,
//! `x-death` headers, confirm and transaction semantics).

mod commits;
mod confirms;
mod dead_letter;
mod disk;
mod dispatch;
mod flow;
mod group_commit;
mod moving;
mod reply_to;
mod routing;
mod support;
mod topology;
mod transactions;

//! The AMQP command dispatcher: each method of an open channel to its
//! handler (transactional publishes and settlements held until tx.commit),
//! and the checks the handlers share (permissions, queue names, exclusive
//! ownership).

use std::sync::Arc;

use bytes::Bytes;
use warren_amqp::amq_protocol::protocol::basic;
use warren_amqp::amq_protocol::types::ShortString;
use warren_amqp::{AmqpError, ChannelId, Command, Reply, ReplyCode};

use super::dispatch::{Settle, check_tx_tag};
use super::state::{Dest, TxOp};
use super::topology::locked;
use super::{Broker, ConnId, TX_COMMIT, err};
use crate::auth::Access;

pub(super) fn method_ids(c: &Command) -> (u16, u16) {
    match c {
        Command::ExchangeDeclare(_) => (40, 10),
        Command::ExchangeDelete(_) => (40, 20),
        Command::ExchangeBind(_) => (40, 30),
        Command::ExchangeUnbind(_) => (40, 40),
        Command::QueueDeclare(_) => (50, 10),
        Command::QueueBind(_) => (50, 20),
        Command::QueuePurge(_) => (50, 30),
        Command::QueueDelete(_) => (50, 40),
        Command::QueueUnbind(_) => (50, 50),
        Command::BasicQos(_) => (60, 10),
        Command::BasicConsume(_) => (60, 20),
        Command::BasicCancel(_) => (60, 30),
        Command::BasicPublish(_) => (60, 40),
        Command::BasicGet(_) => (60, 70),
        Command::BasicAck(_) => (60, 80),
        Command::BasicReject(_) => (60, 90),
        Command::BasicRecoverAsync(_) => (60, 100),
        Command::BasicRecover(_) => (60, 110),
        Command::BasicNack(_) => (60, 120),
        Command::ConfirmSelect(_) => (85, 10),
        Command::TxSelect => (90, 10),
        Command::TxCommit => (90, 20),
        Command::TxRollback => (90, 30),
        _ => (0, 0),
    }
}

impl Broker {
    pub(super) fn check(
        &self,
        id: ConnId,
        access: Access,
        kind: &str,
        name: &str,
    ) -> Result<(), AmqpError> {
        let c = &self.conns[&id];
        let ok = c.perm.as_ref().is_some_and(|p| p.allows(access, name));
        if ok {
            Ok(())
        } else {
            // RabbitMQ 3.10's text names no permission (recorded in
            // `crates/node/tests/http_api/rabbitmq-3.10.json`).
            Err(err(
                ReplyCode::AccessRefused,
                format!(
                    "access to {kind} '{name}' in vhost '{}' refused for user '{}'",
                    c.vhost, c.user
                ),
            ))
        }
    }

    /// The queue `name` if it exists and connection `id` may use it.
    pub(super) fn usable_queue(&self, id: ConnId, name: &str) -> Result<(), AmqpError> {
        let vhost = &self.conns[&id].vhost;
        let q = self
            .vhosts
            .get(vhost)
            .and_then(|v| v.queues.get(name))
            .ok_or_else(|| AmqpError::queue_not_found(name, vhost))?;
        if let Some(owner) = q.owner
            && owner != id
        {
            return Err(locked(name, vhost));
        }
        Ok(())
    }

    /// The queue name of a method, or the channel's last declared queue when empty.
    pub(super) fn queue_name(
        &self,
        id: ConnId,
        ch: ChannelId,
        name: &ShortString,
    ) -> Result<String, AmqpError> {
        if !name.as_str().is_empty() {
            return Ok(name.as_str().to_owned());
        }
        self.conns[&id]
            .channels
            .get(&ch)
            .and_then(|c| c.last_queue.clone())
            .ok_or_else(|| err(ReplyCode::NotFound, "no previously declared queue"))
    }

    pub(super) fn command(
        &mut self,
        id: ConnId,
        ch: ChannelId,
        cmd: Command,
    ) -> Result<(), AmqpError> {
        if !self
            .conns
            .get(&id)
            .is_some_and(|c| c.channels.contains_key(&ch))
        {
            return Ok(());
        }
        match cmd {
            Command::BasicPublish(p) => {
                let c = self.conn(id);
                let chan = c.channels.get_mut(&ch).expect("channel present");
                if let Some(tx) = &mut chan.tx {
                    let mut p = p;
                    p.body = Bytes::copy_from_slice(&p.body);
                    tx.push(TxOp::Publish(Box::new(p)));
                    return Ok(());
                }
                self.publish(id, ch, p)
            }
            Command::BasicAck(a) => {
                let chan = self.conn(id).channels.get_mut(&ch).expect("channel");
                if chan.tx.is_some() {
                    check_tx_tag(chan, a.delivery_tag, a.multiple)?;
                    chan.tx.get_or_insert_default().push(TxOp::Ack(a));
                    return Ok(());
                }
                self.settle(id, ch, a.delivery_tag, a.multiple, Settle::Ack)
            }
            Command::BasicNack(n) => {
                let chan = self.conn(id).channels.get_mut(&ch).expect("channel");
                if chan.tx.is_some() {
                    check_tx_tag(chan, n.delivery_tag, n.multiple)?;
                    chan.tx.get_or_insert_default().push(TxOp::Nack(n));
                    return Ok(());
                }
                let how = if n.requeue {
                    Settle::Requeue
                } else {
                    Settle::Discard
                };
                self.settle(id, ch, n.delivery_tag, n.multiple, how)
            }
            Command::BasicReject(r) => {
                let chan = self.conn(id).channels.get_mut(&ch).expect("channel");
                if chan.tx.is_some() {
                    check_tx_tag(chan, r.delivery_tag, false)?;
                    chan.tx.get_or_insert_default().push(TxOp::Reject(r));
                    return Ok(());
                }
                let how = if r.requeue {
                    Settle::Requeue
                } else {
                    Settle::Discard
                };
                self.settle(id, ch, r.delivery_tag, false, how)
            }
            Command::ExchangeDeclare(d) => self.exchange_declare(id, ch, &d),
            Command::ExchangeDelete(d) => self.exchange_delete(id, ch, &d),
            Command::ExchangeBind(b) => {
                self.bind(
                    id,
                    b.source.as_str(),
                    Dest::Exchange(b.destination.as_str().to_owned()),
                    b.routing_key.as_str(),
                    &b.arguments,
                    true,
                )?;
                if !b.nowait {
                    self.conn(id).amqp.reply(ch, Reply::ExchangeBindOk);
                }
                Ok(())
            }
            Command::ExchangeUnbind(b) => {
                self.bind(
                    id,
                    b.source.as_str(),
                    Dest::Exchange(b.destination.as_str().to_owned()),
                    b.routing_key.as_str(),
                    &b.arguments,
                    false,
                )?;
                if !b.nowait {
                    self.conn(id).amqp.reply(ch, Reply::ExchangeUnbindOk);
                }
                Ok(())
            }
            Command::QueueDeclare(d) => self.queue_declare(id, ch, &d),
            Command::QueueBind(b) => {
                let q = self.queue_name(id, ch, &b.queue)?;
                let q = self.queue_arc(id, &q)?;
                self.bind(
                    id,
                    b.exchange.as_str(),
                    Dest::Queue(q),
                    b.routing_key.as_str(),
                    &b.arguments,
                    true,
                )?;
                if !b.nowait {
                    self.conn(id).amqp.reply(ch, Reply::QueueBindOk);
                }
                Ok(())
            }
            Command::QueueUnbind(b) => {
                let q = self.queue_name(id, ch, &b.queue)?;
                // A missing queue is no error for an unbind (`bind` below).
                let exists = self
                    .vhosts
                    .get(&self.conns[&id].vhost)
                    .is_some_and(|v| v.queues.contains_key(q.as_str()));
                let q = if exists {
                    self.queue_arc(id, &q)?
                } else {
                    Arc::from(q)
                };
                self.bind(
                    id,
                    b.exchange.as_str(),
                    Dest::Queue(q),
                    b.routing_key.as_str(),
                    &b.arguments,
                    false,
                )?;
                self.conn(id).amqp.reply(ch, Reply::QueueUnbindOk);
                Ok(())
            }
            Command::QueuePurge(p) => self.queue_purge(id, ch, &p),
            Command::QueueDelete(d) => self.queue_delete(id, ch, &d),
            Command::BasicQos(q) => {
                let c = self.conn(id);
                let chan = c.channels.get_mut(&ch).expect("channel present");
                if q.global {
                    chan.global_prefetch = q.prefetch_count;
                } else {
                    chan.prefetch = q.prefetch_count;
                }
                c.amqp.reply(ch, Reply::BasicQosOk);
                self.release_held(id, ch);
                self.redrive_channel(id, ch);
                Ok(())
            }
            Command::BasicConsume(c) => self.consume(id, ch, &c),
            Command::BasicCancel(c) => {
                let waits = self.cancel(id, ch, c.consumer_tag.as_str(), c.nowait);
                if !c.nowait && !waits {
                    self.conn(id).amqp.reply(
                        ch,
                        Reply::BasicCancelOk {
                            consumer_tag: c.consumer_tag.as_str().to_owned(),
                        },
                    );
                }
                Ok(())
            }
            Command::BasicGet(g) => self.get(id, ch, &g),
            // RabbitMQ has never implemented redelivery to the same
            // consumer only: a connection error.
            Command::BasicRecover(basic::Recover { requeue: false })
            | Command::BasicRecoverAsync(basic::RecoverAsync { requeue: false }) => {
                Err(err(ReplyCode::NotImplemented, "requeue=false"))
            }
            Command::BasicRecover(_) => {
                // recover-ok goes first, as RabbitMQ sends it: clients drop
                // what they prefetched when it arrives.
                self.conn(id).amqp.reply(ch, Reply::BasicRecoverOk);
                self.recover(id, ch);
                self.redrive_channel(id, ch);
                Ok(())
            }
            Command::BasicRecoverAsync(_) => {
                self.recover(id, ch);
                self.redrive_channel(id, ch);
                Ok(())
            }
            Command::ConfirmSelect(s) => {
                let c = self.conn(id);
                c.channels.get_mut(&ch).expect("channel present").confirm = true;
                if !s.nowait {
                    c.amqp.reply(ch, Reply::ConfirmSelectOk);
                }
                Ok(())
            }
            Command::TxSelect => {
                let c = self.conn(id);
                let chan = c.channels.get_mut(&ch).expect("channel present");
                if chan.tx.is_none() {
                    chan.tx = Some(Vec::new());
                }
                c.amqp.reply(ch, Reply::TxSelectOk);
                Ok(())
            }
            Command::TxCommit => {
                let c = self.conn(id);
                let chan = c.channels.get_mut(&ch).expect("channel present");
                let ops = chan.tx.replace(Vec::new()).unwrap_or_default();
                for op in ops {
                    match op {
                        TxOp::Publish(mut p) => {
                            p.confirm_seq = Some(TX_COMMIT);
                            self.publish(id, ch, *p)?;
                        }
                        TxOp::Ack(a) => {
                            self.settle(id, ch, a.delivery_tag, a.multiple, Settle::Ack)?
                        }
                        TxOp::Nack(n) => {
                            let how = if n.requeue {
                                Settle::Requeue
                            } else {
                                Settle::Discard
                            };
                            self.settle(id, ch, n.delivery_tag, n.multiple, how)?;
                        }
                        TxOp::Reject(r) => {
                            let how = if r.requeue {
                                Settle::Requeue
                            } else {
                                Settle::Discard
                            };
                            self.settle(id, ch, r.delivery_tag, false, how)?;
                        }
                    }
                }
                // Persistent messages on durable queues are on disk before
                // commit-ok: the group commit sends it (see `confirm_one`).
                let c = self.conn(id);
                if c.channels.get(&ch).is_none_or(|chan| chan.tx_wait == 0) {
                    super::publish::finish_commit(c, ch);
                }
                Ok(())
            }
            Command::TxRollback => {
                let c = self.conn(id);
                if let Some(chan) = c.channels.get_mut(&ch) {
                    chan.tx = Some(Vec::new());
                }
                c.amqp.reply(ch, Reply::TxRollbackOk);
                Ok(())
            }
            _ => Err(err(ReplyCode::NotImplemented, "method not implemented")),
        }
    }

    pub(super) fn queue_arc(&self, id: ConnId, name: &str) -> Result<Arc<str>, AmqpError> {
        self.usable_queue(id, name)?;
        let vhost = &self.conns[&id].vhost;
        let v = &self.vhosts[vhost];
        Ok(v.queues
            .get_key_value(name)
            .expect("queue present")
            .0
            .clone())
    }
}

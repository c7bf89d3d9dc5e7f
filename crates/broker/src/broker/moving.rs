//! A client connection moving to another shard of its node (`--shards N`),
//! so that its work is served where its queue lives instead of forwarded
//! there over a link.
//!
//! A connection is given to a shard before it names any queue. If its shell
//! can move it ([`Broker::may_move`]), its first
//! command that names an existing queue mastered on a sibling shard
//! ([`BrokerConfig::siblings`](crate::BrokerConfig)) (a publish to the
//! default exchange, a consume, a get, a declare) is set aside, and the
//! connection asks to move ([`Broker::moving`]) if it holds nothing tied to
//! this shard: no consumer, delivery, confirm or transaction pending, no
//! reply waiting, no exclusive queue. The shell takes it out
//! ([`Broker::detach`]) and hands it to the sibling ([`Broker::attach`]),
//! which handles the command set aside first. A connection is placed once:
//! whatever it names later is forwarded as before.

use std::sync::Arc;

use warren_amqp::{ChannelId, Command, Event};

use super::state::{Channel, Conn};
use super::{Broker, ConnId, Waker};
use crate::broker::link::Elsewhere;

/// A client connection between two shards, with everything it holds.
pub struct Moving(Box<Conn>);

impl std::fmt::Debug for Moving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Moving").field(&self.0.peer).finish()
    }
}

/// Whether `ch` holds nothing a move would strand.
fn channel_free(ch: &Channel) -> bool {
    ch.consumers.is_empty()
        && ch.unacked.is_empty()
        && ch.held.is_empty()
        && ch.fetching == 0
        && ch.confirm_pending.is_empty()
        && ch.confirm_nacked.is_empty()
        && ch.confirm_done.is_empty()
        && ch.tx.as_ref().is_none_or(Vec::is_empty)
        && ch.tx_wait == 0
        && ch.reply_consumer.is_none()
}

/// The queue `cmd` names, if it names one.
fn named_queue(cmd: &Command) -> Option<&str> {
    match cmd {
        Command::BasicPublish(p) if p.exchange.as_str().is_empty() => Some(p.routing_key.as_str()),
        Command::BasicConsume(c) => Some(c.queue.as_str()),
        Command::BasicGet(g) => Some(g.queue.as_str()),
        Command::QueueDeclare(d) => Some(d.queue.as_str()),
        _ => None,
    }
}

impl Broker {
    /// Decides where connection `id` belongs at its first command naming a
    /// queue: `Some(sibling)` if it should move there first (the command is
    /// then kept to be handled after the move), `None` to handle it here.
    pub(super) fn place(
        &mut self,
        id: ConnId,
        channel: ChannelId,
        cmd: Command,
    ) -> Option<Command> {
        if self.cfg.siblings.is_empty() {
            return Some(cmd);
        }
        let Some(c) = self.conns.get(&id) else {
            return Some(cmd);
        };
        if c.placed || c.link.is_some() {
            return Some(cmd);
        }
        let Some(name) = named_queue(&cmd) else {
            return Some(cmd);
        };
        let target = self
            .vhosts
            .get(&c.vhost)
            .and_then(|v| v.queues.get(name))
            .and_then(|q| match &q.remote {
                Some(Elsewhere::Node(n)) if self.cfg.siblings.iter().any(|s| **s == **n) => {
                    Some(n.clone())
                }
                _ => None,
            });
        let free = target.is_some() && self.movable(id);
        let c = self.conns.get_mut(&id).expect("connection present");
        c.placed = true;
        match target {
            Some(to) if free => {
                tracing::debug!(conn = id, to = %to, queue = %name, "moving a connection to its queue's shard");
                c.resume = Some(Event::Command {
                    channel,
                    command: cmd,
                });
                c.moving = Some(to);
                None
            }
            _ => Some(cmd),
        }
    }

    /// Says that connection `id`'s shell can move it to a sibling shard
    /// ([`moving`](Self::moving)); connections are not moved otherwise (the
    /// management API's own, the tests').
    pub fn may_move(&mut self, id: ConnId) {
        if let Some(c) = self.conns.get_mut(&id) {
            c.placed = false;
        }
    }

    /// Whether connection `id` holds nothing tied to this shard.
    fn movable(&self, id: ConnId) -> bool {
        let Some(c) = self.conns.get(&id) else {
            return false;
        };
        let owns_queue = self
            .vhosts
            .get(&c.vhost)
            .is_some_and(|v| v.queues.values().any(|q| q.owner == Some(id)));
        !c.closed
            && c.committing.is_none()
            && c.replies_waiting == 0
            && c.confirm_dirty.is_empty()
            && c.channels.values().all(channel_free)
            && !owns_queue
    }

    /// The sibling shard connection `id` asks to move to, if it does.
    #[must_use]
    pub fn moving(&self, id: ConnId) -> Option<Arc<str>> {
        self.conns.get(&id)?.moving.clone()
    }

    /// Takes connection `id` out to move it ([`moving`](Self::moving)).
    pub fn detach(&mut self, id: ConnId) -> Option<Moving> {
        self.conns.get(&id)?.moving.as_ref()?;
        self.conns.remove(&id).map(|c| Moving(Box::new(c)))
    }

    /// Keeps connection `id` here after all (its sibling is not there): the
    /// command set aside is handled here.
    pub fn stay(&mut self, id: ConnId) {
        if let Some(c) = self.conns.get_mut(&id) {
            c.moving = None;
            self.current = id;
            self.process_events(id, None);
        }
    }

    /// Takes in a connection moved from a sibling shard; `waker` wakes its
    /// task. Handles the command it set aside, and what followed it.
    pub fn attach(&mut self, m: Moving, waker: Waker, now_ms: u64) -> ConnId {
        let id = self.next_conn;
        self.next_conn += 1;
        let mut c = m.0;
        c.moving = None;
        c.waker = waker;
        c.amqp.hold_publishes(self.alarmed());
        self.conns.insert(id, *c);
        self.now = now_ms;
        self.current = id;
        self.process_events(id, None);
        id
    }
}

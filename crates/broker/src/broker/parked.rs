//! Publishes held for a mirrored queue while it has no master: its master
//! is handing it over (draining, or gone and no successor named yet).
//!
//! RabbitMQ's channels send every publish to each mirror as well, so a
//! master's move loses no publish in flight and nacks none. Warren's
//! mirrors learn a publish from the master's ring instead, so a node holds
//! the publishes for such a queue here, in order, and sends them on to the
//! next master once the queue is served again (`set_queue_master`,
//! `end_replica`, or the tick). A queue deleted meanwhile confirms them (as
//! the messages of a deleted queue); a queue that stays without a master
//! for [`PARK_LIMIT_MS`], or more than [`PARK_MAX_BYTES`] held, nacks them
//! (the publisher resends).
//!
//! Likewise when a mirrored queue's master's node goes down (its link is
//! given up, `Broker::link_down`): the publishes forwarded there and not
//! confirmed are held first, under the identity they were forwarded with
//! (`Sent::Again`), so that the next master confirms those its ring
//! delivered before the old one died and takes the others; the publishes
//! that come meanwhile wait behind them. Each is nacked
//! [`RESEND_WAIT_MS`](super::link::RESEND_WAIT_MS) after its client
//! published it if no master takes the queue by then.
//!
//! And when a mirrored queue's master moves from one node to another while
//! publishes forwarded to the old one are not yet confirmed: the old
//! master's node holds them too, and sends them on to the new master
//! itself. Publishes that come meanwhile are held here ([`OldMaster`])
//! until the old master's node settled those, at most
//! [`RESEND_WAIT_MS`](super::link::RESEND_WAIT_MS): sent straight to the
//! new master they would reach it first, out of their channel's order.
//! When the new master is this node, those the old master's node passes on
//! here go in at once, ahead of what is held, and so do those it passed on
//! before this node heard of the move (held here meanwhile): the wait ends
//! when they are confirmed back to it.
//!
//! Other work on such a queue waits likewise, in `link.rs`: a declare for
//! the next master's counts (`hold_count`), a get for the next master
//! (`link_get` with no node, sent on by `redirect_gets`), both after the
//! held publishes; a consumer that leaves meanwhile is told to the next
//! master (`consumer_left_unseen`, for auto-delete).

use std::collections::VecDeque;
use std::sync::Arc;

use warren_amqp::ChannelId;

use super::state::{Msg, Queue};
use super::{Broker, Conn, ConnId, Elsewhere, IdMap, Store, confirm_one, nack_one};

/// How long a publish waits for its queue's next master before it is nacked.
pub(super) const PARK_LIMIT_MS: u64 = 10_000;

/// The most message bytes one queue holds while it has no master; a
/// publish past it is nacked at once.
pub(super) const PARK_MAX_BYTES: usize = 64 << 20;

/// A mirrored queue's previous master, whose node still holds publishes
/// forwarded to it before the master moved (see the module doc).
#[derive(Debug)]
pub(super) struct OldMaster {
    /// The previous master's node.
    node: Arc<str>,
    /// The link ids of the publishes forwarded there before the move and
    /// not yet settled, which come first.
    ids: Vec<u64>,
    /// When (ms) publishes stop waiting for them.
    until_ms: u64,
}

/// One held publish.
#[derive(Debug)]
struct Held {
    msg: Msg,
    confirm: Option<(ConnId, ChannelId, u64)>,
    /// When it is nacked if the queue has no master by then.
    deadline_ms: u64,
}

/// A queue's held publishes, oldest first.
#[derive(Debug, Default)]
pub(super) struct Parked {
    held: VecDeque<Held>,
    bytes: usize,
}

impl Parked {
    /// Whether nothing is held.
    pub(super) fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Holds `msg` until `deadline_ms`; `false` (nothing held) if the
    /// queue holds too much.
    pub(super) fn hold(
        &mut self,
        msg: &Msg,
        confirm: Option<(ConnId, ChannelId, u64)>,
        deadline_ms: u64,
    ) -> bool {
        let len = msg.meta.len() + msg.body.len();
        if self.bytes + len > PARK_MAX_BYTES {
            return false;
        }
        self.bytes += len;
        self.held.push_back(Held {
            msg: msg.clone(),
            confirm,
            deadline_ms,
        });
        true
    }

    /// Takes out, in order, the held publishes that node `from` forwarded
    /// (their confirms go back over its link, `conns`).
    fn take_from(&mut self, from: &str, conns: &IdMap<ConnId, Conn>) -> VecDeque<Held> {
        let by = |h: &Held| {
            h.confirm
                .and_then(|(conn, ..)| super::link::link_origin(conns, conn))
                .is_some_and(|origin| origin == from)
        };
        if !self.held.iter().any(by) {
            return VecDeque::new();
        }
        let (taken, kept) = std::mem::take(&mut self.held).into_iter().partition(by);
        self.held = kept;
        for h in &taken {
            self.bytes -= h.msg.meta.len() + h.msg.body.len();
        }
        taken
    }

    /// The confirms the held publishes owe.
    pub(super) fn confirms(&self) -> impl Iterator<Item = (ConnId, ChannelId, u64)> + '_ {
        self.held.iter().filter_map(|h| h.confirm)
    }
}

impl Queue {
    /// Whether a publish to it can go on now: to its master's node, or into
    /// this node's store (a master replica that is not draining).
    pub(super) fn takes_publishes(&self) -> bool {
        self.old_master.is_none() && self.served()
    }

    /// Whether a publish forwarded by node `from` (`None`: not forwarded)
    /// goes in now, not behind publishes held here: the
    /// queue takes publishes and holds none, or `from` is the previous
    /// master's node passing on those that came before what is held
    /// ([`OldMaster`]).
    pub(super) fn takes_publishes_from(&self, from: Option<&str>) -> bool {
        match (&self.old_master, from) {
            (Some(o), Some(from)) if *o.node == *from => self.served(),
            _ => self.takes_publishes() && self.parked.is_empty(),
        }
    }

    /// Whether it has a master to take publishes now, waits aside.
    fn served(&self) -> bool {
        match &self.remote {
            Some(Elsewhere::Nowhere) => false,
            Some(Elsewhere::Node(n)) => !self.master_is_stale(n),
            None => match &self.store {
                Store::Replica(m) => m.replica.takes_publishes(),
                Store::Local(_) => true,
            },
        }
    }

    /// Whether master `node`, as this node knows it, has sent work for the
    /// queue here ([`Queue::stale_master`]), or its link is down
    /// ([`Queue::master_down`]).
    fn master_is_stale(&self, node: &str) -> bool {
        let is = |m: &Option<(Arc<str>, u64)>| m.as_ref().is_some_and(|(n, _)| &**n == node);
        is(&self.stale_master) || is(&self.master_down)
    }

    /// Whether it has no master right now: handed over with no successor
    /// named yet, or its replica here is not a working master.
    pub(super) fn between_masters(&self) -> bool {
        match &self.remote {
            Some(Elsewhere::Nowhere) => true,
            Some(Elsewhere::Node(n)) => self.master_is_stale(n),
            // Draining, just stopped, or a mirror not yet promoted.
            None => matches!(&self.store, Store::Replica(m) if !m.replica.takes_publishes()),
        }
    }
}

impl Broker {
    /// Holds a publish to queue `name` (see the module doc); `false` if it
    /// holds too much already (the caller nacks).
    pub(super) fn park(
        &mut self,
        vhost: &str,
        name: &Arc<str>,
        msg: &Msg,
        confirm: Option<(ConnId, ChannelId, u64)>,
    ) -> bool {
        let now = self.now;
        let Some(q) = self.queue_mut(vhost, name) else {
            return false;
        };
        // Waiting for a master whose node is down: as long as a publish
        // forwarded there waits for the next master.
        let wait = if q.master_down.is_some() {
            super::link::RESEND_WAIT_MS
        } else {
            PARK_LIMIT_MS
        };
        if !q.parked.hold(msg, confirm, now + wait) {
            tracing::warn!(%vhost, queue = %name, "too many publishes held for a queue without a master: nacked");
            return false;
        }
        self.parked_queues.insert((vhost.to_owned(), name.clone()));
        true
    }

    /// Holds `sent` (message, confirm owed, deadline), forwarded before and
    /// not confirmed, ahead of what queue `name` holds (which came after
    /// them), whatever it holds already.
    pub(super) fn park_first(
        &mut self,
        vhost: &str,
        name: &Arc<str>,
        sent: impl DoubleEndedIterator<Item = (Msg, Option<(ConnId, ChannelId, u64)>, u64)>,
    ) {
        let Some(q) = self.queue_mut(vhost, name) else {
            return;
        };
        for (msg, confirm, deadline_ms) in sent.rev() {
            q.parked.bytes += msg.meta.len() + msg.body.len();
            q.parked.held.push_front(Held {
                msg,
                confirm,
                deadline_ms,
            });
        }
        self.parked_queues.insert((vhost.to_owned(), name.clone()));
    }

    /// Queue `name`'s master moved from node `previous`: if publishes
    /// forwarded there are not yet settled, the next ones wait for them
    /// (see the module doc).
    pub(super) fn wait_for_old_master(&mut self, vhost: &str, name: &str, previous: Arc<str>) {
        let ids = self.links.unsettled(&previous, vhost, name);
        if ids.is_empty() {
            return;
        }
        let until_ms = self.now + super::link::RESEND_WAIT_MS;
        let Some(q) = self.queue_mut(vhost, name) else {
            return;
        };
        tracing::debug!(%vhost, queue = %name, previous = %previous, "publishes wait for those forwarded to the previous master");
        q.old_master = Some(OldMaster {
            node: previous,
            ids,
            until_ms,
        });
        let name = q.name.clone();
        self.old_master_waits.insert((vhost.to_owned(), name));
    }

    /// Ends the waits for old masters whose forwarded publishes are
    /// settled (or that waited long enough), sending on what they held.
    pub(super) fn end_old_master_waits(&mut self) {
        if self.old_master_waits.is_empty() {
            return;
        }
        let queues: Vec<(String, Arc<str>)> = self.old_master_waits.iter().cloned().collect();
        for (vhost, name) in queues {
            if !self.old_master_pending(&vhost, &name) {
                self.unpark(&vhost, &name);
            }
        }
    }

    /// Whether queue `name` still waits for its old master's publishes;
    /// clears the wait if not.
    fn old_master_pending(&mut self, vhost: &str, name: &str) -> bool {
        let now = self.now;
        let wait = self
            .vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(name))
            .map(|q| q.old_master.as_mut());
        let links = &self.links;
        let pending = match wait {
            // No wait (the common case): nothing to clear.
            Some(None) => return false,
            Some(Some(o)) => {
                o.ids.retain(|id| links.is_unsettled(*id));
                now < o.until_ms && !o.ids.is_empty()
            }
            // The queue is gone.
            None => false,
        };
        if !pending {
            if let Some(q) = self.queue_mut(vhost, name) {
                q.old_master = None;
            }
            self.old_master_waits
                .retain(|(v, n)| !(v == vhost && &**n == name));
        }
        pending
    }

    /// Sends queue `name`'s held publishes on if it is served again;
    /// otherwise nacks those held for longer than [`PARK_LIMIT_MS`].
    pub(super) fn unpark(&mut self, vhost: &str, name: &str) {
        let now = self.now;
        self.old_master_pending(vhost, name);
        let Some(q) = self.queue_mut(vhost, name) else {
            self.parked_queues
                .retain(|(v, n)| !(v == vhost && &**n == name));
            return;
        };
        // Heard of no move in time: the master this node knows is taken
        // at its word again.
        for m in [&mut q.stale_master, &mut q.master_down] {
            if m.as_ref().is_some_and(|(_, until)| now >= *until) {
                *m = None;
            }
        }
        let qname = q.name.clone();
        let waiting = self.links.wait_for_master(vhost, name);
        let Some(q) = self.queue_mut(vhost, name) else {
            return;
        };
        let mut settled = false;
        if q.takes_publishes() {
            let master = q.remote.as_ref().and_then(Elsewhere::node).cloned();
            let held = std::mem::take(&mut q.parked);
            self.parked_queues
                .remove(&(vhost.to_owned(), qname.clone()));
            tracing::debug!(%vhost, queue = %qname, held = held.held.len(), "queue served again: sending on the publishes held for it");
            settled = self.send_on(vhost, &qname, held.held);
            // Declares and gets held meanwhile, after what just went in: to
            // the master, or (`None`) answered here.
            self.redirect_counts(vhost, name, master.as_deref(), true);
            self.redirect_gets(vhost, name, master.as_deref());
        } else {
            // Waiting for the old master's node, which passed some of what
            // it held on here before this node knew of the move: those go
            // in now, ahead (the wait ends once they are confirmed there).
            let passed = match &q.old_master {
                Some(o) if q.served() => {
                    let (node, conns) = (o.node.clone(), &self.conns);
                    (self.vhosts.get_mut(vhost))
                        .and_then(|v| v.queues.get_mut(name))
                        .map(|q| q.parked.take_from(&node, conns))
                        .unwrap_or_default()
                }
                _ => VecDeque::new(),
            };
            if !passed.is_empty() {
                tracing::debug!(%vhost, queue = %qname, passed = passed.len(), "publishes the old master passed on before the move was known: in now");
                settled |= self.send_on(vhost, &qname, passed);
            }
            let Some(q) = self.queue_mut(vhost, name) else {
                return;
            };
            let mut late = Vec::new();
            while let Some(h) = q.parked.held.front()
                && now >= h.deadline_ms
            {
                let Some(h) = q.parked.held.pop_front() else {
                    break;
                };
                q.parked.bytes -= h.msg.meta.len() + h.msg.body.len();
                late.extend(h.confirm);
            }
            if q.parked.is_empty() && !waiting {
                self.parked_queues
                    .remove(&(vhost.to_owned(), qname.clone()));
            }
            if !late.is_empty() {
                tracing::warn!(%vhost, queue = %qname, nacked = late.len(), "no master took the queue in time: held publishes nacked");
            }
            for (conn, ch, cseq) in late {
                nack_one(&mut self.conns, conn, ch, cseq);
                settled = true;
            }
        }
        if settled {
            self.wake_clients();
        }
    }

    /// Enqueues `held` into queue `name`, in order, settling at once those
    /// that owe no wait; whether any owed a confirm.
    fn send_on(
        &mut self,
        vhost: &str,
        name: &Arc<str>,
        held: impl IntoIterator<Item = Held>,
    ) -> bool {
        let mut settled = false;
        // Nacks of the caller's own enqueue, if any, stay its own.
        let outer = std::mem::take(&mut self.deferred_nacks);
        let target = [name.clone()];
        for h in held {
            match self.enqueue(vhost, &target, &h.msg, h.confirm) {
                Ok(0) => {
                    if let Some((conn, ch, cseq)) = h.confirm {
                        confirm_one(&mut self.conns, conn, ch, cseq);
                    }
                }
                Ok(_) => {}
                Err(_) => {
                    if let Some((conn, ch, cseq)) = h.confirm {
                        nack_one(&mut self.conns, conn, ch, cseq);
                    }
                }
            }
            settled |= h.confirm.is_some();
        }
        for (conn, ch, cseq) in std::mem::replace(&mut self.deferred_nacks, outer) {
            nack_one(&mut self.conns, conn, ch, cseq);
        }
        settled
    }

    /// Sends on (or times out) the publishes held for every queue that
    /// holds some; the broker's tick.
    pub(super) fn unpark_all(&mut self) {
        if self.parked_queues.is_empty() {
            return;
        }
        let queues: Vec<(String, Arc<str>)> = self.parked_queues.iter().cloned().collect();
        for (vhost, name) in queues {
            self.unpark(&vhost, &name);
        }
    }
}

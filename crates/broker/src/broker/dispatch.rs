//! Queue dispatch: handing ready messages to consumers within their
//! prefetch limits, consume and cancel, basic.get, and settling deliveries
//! (ack, nack, reject, recover).

use std::sync::Arc;

use warren_amqp::amq_protocol::protocol::basic;
use warren_amqp::amq_protocol::types::AMQPValue;
use warren_amqp::{AmqpError, ChannelId, ContentMethod, Reply, ReplyCode};
use warren_backing_queue::Dropped;

use super::state::{Channel, Conn, Consumer, IdMap, Pace, Queue, Unacked};
use super::{
    Broker, ConnId, Elsewhere, FetchForArgs, MAX_FETCHES_IN_FLIGHT, OUTPUT_HIGH_WATER, Store, err,
    random_name,
};
use crate::auth::Access;
use crate::routing::decode_meta;

/// Which consumer of `q` gets its next message: of those `has_room`
/// accepts, the highest `x-priority`, in turn from `q.rr` among equals (as
/// RabbitMQ's consumer priorities); on a single-active-consumer queue, its
/// active consumer or none.
fn pick(q: &mut Queue, mut has_room: impl FnMut(&Consumer) -> bool) -> Option<usize> {
    if q.single_active {
        let i = q.active_consumer()?;
        return has_room(&q.consumers[i]).then_some(i);
    }
    let n = q.consumers.len();
    let top = q.consumers.iter().map(|c| c.priority).max()?;
    let mut chosen: Option<usize> = None;
    for i in 0..n {
        let idx = (q.rr + i) % n;
        let c = &q.consumers[idx];
        if chosen.is_some_and(|b| q.consumers[b].priority >= c.priority) || !has_room(c) {
            continue;
        }
        chosen = Some(idx);
        if c.priority == top {
            // None ranks higher: the usual case (no priorities) stops here.
            break;
        }
    }
    chosen
}

/// Hands ready messages of `q` to its consumers (see [`pick`]) within
/// their prefetch limits. Returns false if its store failed to read one.
#[must_use]
fn drive(q: &mut Queue, conns: &mut IdMap<ConnId, Conn>, now: u64, current: ConnId) -> bool {
    if q.consumers.is_empty() || q.remote.is_some() {
        return true;
    }
    q.last_used_ms = q.last_used_ms.max(now);
    if matches!(q.store, Store::Replica(_)) {
        drive_replica(q, conns, now);
        return true;
    }
    loop {
        if q.store.stats().ready == 0 {
            return true;
        }
        let mut paced = false;
        let chosen = pick(q, |c| {
            let Some(conn) = conns.get_mut(&c.conn) else {
                return false;
            };
            let Some(ch) = conn.channels.get(&c.channel) else {
                return false;
            };
            if c.prefetch != 0 && c.unacked >= u32::from(c.prefetch) && !c.no_ack {
                return false;
            }
            if ch.global_prefetch != 0
                && ch.unacked.len() >= usize::from(ch.global_prefetch)
                && !c.no_ack
            {
                return false;
            }
            if !c.no_ack && c.pace.behind(now) {
                paced = true;
                return false;
            }
            if conn.out_pending >= OUTPUT_HIGH_WATER {
                conn.throttled = true;
                return false;
            }
            true
        });
        q.paced |= paced;
        let Some(idx) = chosen else {
            return true;
        };
        let Store::Local(bq) = &mut q.store else {
            return true;
        };
        let delivery = match bq.fetch(now) {
            Ok(Some(d)) => d,
            Ok(None) => return true,
            Err(e) => {
                tracing::error!(queue = %q.name, error = %e, "fetch failed");
                return false;
            }
        };
        q.rr = idx + 1;
        q.delivered_at_ms = now;
        q.counters.delivered += 1;
        q.counters.redelivered += u64::from(delivery.redelivered);
        let c = &mut q.consumers[idx];
        let Some(conn) = conns.get_mut(&c.conn) else {
            continue;
        };
        let Some(ch) = conn.channels.get_mut(&c.channel) else {
            continue;
        };
        ch.next_tag += 1;
        let tag = ch.next_tag;
        if c.no_ack {
            if let Err(e) = bq.ack(delivery.tag) {
                tracing::error!(queue = %q.name, error = %e, "ack failed");
            }
        } else {
            c.unacked += 1;
            ch.unacked.insert(
                tag,
                Unacked {
                    queue: q.name.clone(),
                    bq_tag: delivery.tag,
                    consumer: Some(c.tag.clone()),
                    seq: c.pace.sent(),
                    remote: None,
                    delivered_at_ms: now,
                },
            );
        }
        let m = decode_meta(&delivery.props);
        conn.send_message(
            c.channel,
            &ContentMethod::Deliver {
                consumer_tag: &c.tag,
                delivery_tag: tag,
                redelivered: delivery.redelivered,
                exchange: m.exchange,
                routing_key: m.routing_key,
            },
            &m.properties,
            &delivery.props,
            &delivery.body,
        );
        conn.out_pending += delivery.body.len() + 64;
        let cid = c.conn;
        conn.wake(current, cid);
    }
}

/// Fetches from a mirrored queue's replica for its consumers, round-robin,
/// within their prefetch limits (counting fetches not yet handed out); the
/// deliveries go out when the ring holds the fetches.
pub(super) fn drive_replica(q: &mut Queue, conns: &mut IdMap<ConnId, Conn>, now: u64) {
    if !matches!(q.store, Store::Replica(_)) || !q.store.serves() {
        return;
    }
    loop {
        if q.store.stats().ready == 0 {
            return;
        }
        let mut paced = false;
        let chosen = pick(q, |c| {
            let Some(conn) = conns.get_mut(&c.conn) else {
                return false;
            };
            let Some(ch) = conn.channels.get(&c.channel) else {
                return false;
            };
            if c.prefetch != 0 && c.unacked >= u32::from(c.prefetch) && !c.no_ack {
                return false;
            }
            if ch.global_prefetch != 0
                && ch.unacked.len() + ch.fetching as usize >= usize::from(ch.global_prefetch)
                && !c.no_ack
            {
                return false;
            }
            // Fetches in flight come back through `mirror_turn`, which
            // drives the queue again; a full socket buffer is retried once
            // the connection's output is written (`throttled`).
            if c.reserved >= MAX_FETCHES_IN_FLIGHT {
                return false;
            }
            if !c.no_ack && c.pace.behind(now) {
                paced = true;
                return false;
            }
            if conn.out_pending >= OUTPUT_HIGH_WATER {
                conn.throttled = true;
                return false;
            }
            true
        });
        q.paced |= paced;
        let Some(idx) = chosen else {
            return;
        };
        q.rr = idx + 1;
        let c = &mut q.consumers[idx];
        let f = FetchForArgs::consumer(c.conn, c.channel, c.tag.clone(), c.no_ack);
        let Store::Replica(m) = &mut q.store else {
            return;
        };
        if !m.fetch(now, f) {
            return;
        }
        c.reserved += 1;
        if !c.no_ack {
            c.unacked += 1;
            if let Some(ch) = conns
                .get_mut(&c.conn)
                .and_then(|x| x.channels.get_mut(&c.channel))
            {
                ch.fetching += 1;
            }
        }
    }
}

impl Broker {
    /// After a queue changed: dead-letters what it dropped, hands ready
    /// messages to consumers.
    pub(super) fn after_queue_op(&mut self, vhost: &str, qname: &str) {
        let Some(v) = self.vhosts.get_mut(vhost) else {
            return;
        };
        let Some(q) = v.queues.get_mut(qname) else {
            return;
        };
        if !drive(q, &mut self.conns, self.now, self.current) && q.dir.is_some() {
            // The durable queue's log failed a read (a bad sector, a
            // failing disk): as when a write fails.
            self.fail_log(vhost, qname);
            return;
        }
        if matches!(q.store, Store::Replica(_)) {
            self.mirror_turn(vhost, qname);
        }
        let Some(q) = self
            .vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(qname))
        else {
            return;
        };
        let mut dropped: Vec<Dropped> = Vec::new();
        q.store.take_dropped(&mut dropped);
        if q.dlx.is_some() {
            // Each dropped message comes with its content (the store read a
            // paged-out one back), whoever published it: this node or, before
            // a failover, another master.
            for d in dropped {
                let Some(data) = d.data else {
                    tracing::warn!(queue = %qname, seq = d.seq, "a dropped message could not be read back: not dead-lettered");
                    continue;
                };
                let split = (d.props_len as usize).min(data.len());
                let (meta, body) = (data.slice(..split), data.slice(split..));
                self.dead.extend(q.dead_letter(vhost, d.reason, meta, body));
            }
            // Expired messages at the head may have gone during the fetches.
            if !drive(q, &mut self.conns, self.now, self.current) && q.dir.is_some() {
                self.fail_log(vhost, qname);
            }
        }
        // What it owes the disk that nobody waits for (a no-ack delivery's
        // removal, an ack) goes with the next group commit, or within
        // 100 ms.
        let owed = self
            .vhosts
            .get(vhost)
            .and_then(|v| v.queues.get(qname))
            .is_some_and(|q| q.store.needs_sync() && !q.store.awaits_sync());
        if owed {
            self.want_lazy_sync();
        }
        self.dead_letter();
    }

    pub(super) fn settle(
        &mut self,
        id: ConnId,
        ch: ChannelId,
        tag: u64,
        multiple: bool,
        how: Settle,
    ) -> Result<(), AmqpError> {
        let c = self.conn(id);
        let Some(chan) = c.channels.get_mut(&ch) else {
            return Ok(());
        };
        let taken: Vec<(u64, Unacked)> = if multiple {
            if tag == 0 {
                // Everything delivered: not what its global prefetch holds.
                let rest = match chan.held.front() {
                    Some(h) => chan.unacked.split_off(&h.tag),
                    None => std::collections::BTreeMap::new(),
                };
                std::mem::replace(&mut chan.unacked, rest)
                    .into_iter()
                    .collect()
            } else {
                // As RabbitMQ's channel: the tag itself must be unsettled
                // (one past the last delivery settles nothing).
                if !chan.unacked.contains_key(&tag) {
                    return Err(unknown_tag(tag));
                }
                let rest = chan.unacked.split_off(&(tag + 1));
                let upto = std::mem::replace(&mut chan.unacked, rest);
                upto.into_iter().collect()
            }
        } else {
            match chan.unacked.remove(&tag) {
                Some(u) => vec![(tag, u)],
                None => return Err(unknown_tag(tag)),
            }
        };
        self.settle_taken(id, ch, taken, how);
        Ok(())
    }

    /// Settles deliveries `tags` of a forwarding link's channel together
    /// (a closed channel's requeues go back at once, as RabbitMQ's do);
    /// tags it does not hold are skipped.
    pub(super) fn settle_many(&mut self, id: ConnId, ch: ChannelId, tags: &[u64], how: Settle) {
        let Some(chan) = self.conn(id).channels.get_mut(&ch) else {
            return;
        };
        let taken = tags
            .iter()
            .filter_map(|t| Some((*t, chan.unacked.remove(t)?)))
            .collect();
        self.settle_taken(id, ch, taken, how);
    }

    /// Acks, requeues or discards the deliveries `taken` from channel `ch`
    /// of connection `id`, then drives each queue they came from once.
    fn settle_taken(&mut self, id: ConnId, ch: ChannelId, taken: Vec<(u64, Unacked)>, how: Settle) {
        let c = self.conn(id);
        let vhost = c.vhost.clone();
        if matches!(how, Settle::Ack) && c.link.is_none() {
            c.count(ch, |n| n.acknowledged += taken.len() as u64);
        }
        let mut touched: Vec<Arc<str>> = Vec::new();
        let mut forwarded = Vec::new();
        let now = self.now;
        // Settled together: one consumer's batch, on a channel of one.
        let together = taken.len() as u64;
        for (_, u) in taken {
            if let Some(node) = u.remote {
                forwarded.push((node, u.bq_tag));
                continue;
            }
            let Some(q) = self
                .vhosts
                .get_mut(&vhost)
                .and_then(|v| v.queues.get_mut(&u.queue))
            else {
                continue;
            };
            let res = match how {
                Settle::Ack => {
                    q.counters.acked += 1;
                    q.store.ack(u.bq_tag)
                }
                Settle::Requeue => q.store.requeue(u.bq_tag),
                Settle::Discard => q.store.discard(u.bq_tag),
            };
            if let Err(e) = res {
                q.settle_failed("settling a delivery", &e);
            }
            if let Some(t) = &u.consumer
                && let Some(cons) = q
                    .consumers
                    .iter_mut()
                    .find(|x| x.conn == id && x.channel == ch && &x.tag == t)
            {
                cons.unacked = cons.unacked.saturating_sub(1);
                cons.pace.settled(u.seq, now, together);
                q.settled_at_ms = now;
            }
            if touched.last() != Some(&u.queue) {
                touched.push(u.queue);
            }
        }
        self.link_settle_all(&vhost, forwarded, how);
        touched.sort();
        touched.dedup();
        for q in touched {
            self.after_queue_op(&vhost, &q);
        }
        // A global prefetch frees room on every queue this channel consumes.
        if self.conns[&id]
            .channels
            .get(&ch)
            .is_some_and(|c| c.global_prefetch != 0)
        {
            self.release_held(id, ch);
            self.redrive_channel(id, ch);
        }
    }

    /// Sends the deliveries of forwarded queues that channel `ch`'s global
    /// prefetch held back, as far as it has room now (all of them once it
    /// has no global prefetch); those settled meanwhile (recovered, the
    /// consumer cancelled) are dropped.
    pub(super) fn release_held(&mut self, id: ConnId, ch: ChannelId) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        loop {
            let Some(chan) = c.channels.get_mut(&ch) else {
                return;
            };
            let Some(front) = chan.held.front() else {
                return;
            };
            if !chan.unacked.contains_key(&front.tag) {
                chan.held.pop_front();
                continue;
            }
            let sent = chan.unacked.range(..front.tag).count();
            if chan.global_prefetch != 0 && sent >= usize::from(chan.global_prefetch) {
                return;
            }
            let Some(h) = chan.held.pop_front() else {
                return;
            };
            let m = decode_meta(&h.meta);
            c.count_delivery(ch, h.redelivered);
            c.amqp.send_content(
                ch,
                &ContentMethod::Deliver {
                    consumer_tag: &h.consumer,
                    delivery_tag: h.tag,
                    redelivered: h.redelivered,
                    exchange: m.exchange,
                    routing_key: m.routing_key,
                },
                &m.properties,
                &h.body,
            );
            c.wake(self.current, id);
        }
    }

    /// Closes, with RabbitMQ's 406 and text, each client channel whose
    /// oldest unacknowledged delivery is older than the consumer timeout
    /// (looked at once a second; RabbitMQ looks on its channel tick).
    pub(super) fn time_out_deliveries(&mut self, now_ms: u64) {
        if now_ms.saturating_sub(self.last_ack_check_ms) < 1_000 {
            return;
        }
        self.last_ack_check_ms = now_ms;
        let timeout = self.cfg.consumer_timeout_ms;
        for (id, c) in &mut self.conns {
            if c.link.is_some() {
                continue;
            }
            let late: Vec<ChannelId> = c
                .channels
                .iter()
                .filter(|(_, ch)| {
                    ch.unacked
                        .first_key_value()
                        .is_some_and(|(_, u)| now_ms.saturating_sub(u.delivered_at_ms) > timeout)
                })
                .map(|(n, _)| *n)
                .collect();
            for ch in late {
                tracing::warn!(
                    conn = id,
                    channel = ch,
                    timeout_ms = timeout,
                    "a delivery went unacknowledged past the consumer timeout: closing its channel"
                );
                c.amqp.channel_error(
                    ch,
                    err(
                        ReplyCode::PreconditionFailed,
                        format!(
                            "delivery acknowledgement on channel {ch} timed out. Timeout value used: {timeout} ms. This timeout value can be configured, see consumers doc guide to learn more"
                        ),
                    ),
                );
                c.woken = true;
                (c.waker)();
            }
        }
    }

    pub(super) fn redrive_channel(&mut self, id: ConnId, ch: ChannelId) {
        let c = &self.conns[&id];
        let vhost = c.vhost.clone();
        let mut queues: Vec<Arc<str>> = c
            .channels
            .get(&ch)
            .map(|c| c.consumers.values().cloned().collect())
            .unwrap_or_default();
        queues.sort();
        queues.dedup();
        for q in queues {
            self.after_queue_op(&vhost, &q);
        }
    }

    pub(super) fn recover(&mut self, id: ConnId, ch: ChannelId) {
        let c = self.conn(id);
        let vhost = c.vhost.clone();
        let Some(chan) = c.channels.get_mut(&ch) else {
            return;
        };
        let taken = std::mem::take(&mut chan.unacked);
        let mut touched = Vec::new();
        let mut forwarded = Vec::new();
        let now = self.now;
        for u in taken.into_values() {
            if let Some(node) = u.remote {
                forwarded.push((node, u.bq_tag));
                continue;
            }
            if let Some(q) = self
                .vhosts
                .get_mut(&vhost)
                .and_then(|v| v.queues.get_mut(&u.queue))
            {
                if let Err(e) = q.store.requeue(u.bq_tag) {
                    q.settle_failed("requeue", &e);
                }
                if let Some(t) = &u.consumer
                    && let Some(cons) = q
                        .consumers
                        .iter_mut()
                        .find(|x| x.conn == id && x.channel == ch && &x.tag == t)
                {
                    cons.unacked = cons.unacked.saturating_sub(1);
                    // A recover is no ack batch: it says nothing of the
                    // consumer's pace but that it is at its latest.
                    cons.pace.settled(u.seq, now, 1);
                }
                touched.push(u.queue);
            }
        }
        self.link_settle_all(&vhost, forwarded, Settle::Requeue);
        // What its global prefetch held went back with the rest.
        if let Some(chan) = self.conn(id).channels.get_mut(&ch) {
            chan.held.clear();
        }
        touched.sort();
        touched.dedup();
        for q in touched {
            self.after_queue_op(&vhost, &q);
        }
    }

    pub(super) fn consume(
        &mut self,
        id: ConnId,
        ch: ChannelId,
        c: &basic::Consume,
    ) -> Result<(), AmqpError> {
        if c.queue.as_str() == super::reply_to::REPLY_TO {
            return self.consume_reply_to(id, ch, c);
        }
        let name = self.queue_name(id, ch, &c.queue)?;
        let qarc = self.queue_arc(id, &name)?;
        self.check(id, Access::Read, "queue", &name)?;
        let vhost = self.conns[&id].vhost.clone();
        let priority = match c.arguments.inner().get("x-priority") {
            None => 0,
            Some(v) => match crate::routing::as_i64(v) {
                Some(p) => p.clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32,
                None => {
                    return Err(err(
                        ReplyCode::PreconditionFailed,
                        format!(
                            "invalid arg 'x-priority' for queue '{name}' in vhost '{vhost}': \"expected integer, got {}\"",
                            crate::routing::type_name(v)
                        ),
                    ));
                }
            },
        };
        let mut tag = c.consumer_tag.as_str().to_owned();
        if tag.is_empty() {
            tag = random_name("amq.ctag-");
        }
        let tag: Arc<str> = Arc::from(tag.as_str());
        let conn = &self.conns[&id];
        let chan = conn.channels.get(&ch).expect("channel present");
        if chan.consumers.contains_key(&tag) {
            return Err(err(
                ReplyCode::NotAllowed,
                format!("attempt to reuse consumer tag '{tag}'"),
            ));
        }
        let prefetch = chan.prefetch;
        let q = self
            .vhosts
            .get_mut(&vhost)
            .and_then(|v| v.queues.get_mut(&qarc))
            .expect("queue present");
        // This node's consumers; a forwarded consume is refused by the
        // master, which knows every node's (`LinkMsg::ConsumeRefused`).
        if let Some(text) = q.refuses_consumer(c.exclusive, &vhost) {
            return Err(err(ReplyCode::AccessRefused, text));
        }
        let mut consumer = Consumer {
            tag: tag.clone(),
            conn: id,
            channel: ch,
            no_ack: c.no_ack,
            exclusive: c.exclusive,
            prefetch,
            unacked: 0,
            reserved: 0,
            remote_cid: 0,
            cancel_on_failover: matches!(
                c.arguments.inner().get("x-cancel-on-ha-failover"),
                Some(AMQPValue::Boolean(true))
            ),
            priority,
            pace: Pace::default(),
        };
        let waits = q.remote.is_some() && self.link_consume(&vhost, &qarc, &mut consumer, c.nowait);
        let q = self
            .vhosts
            .get_mut(&vhost)
            .and_then(|v| v.queues.get_mut(&qarc))
            .expect("queue present");
        q.add_consumer(consumer);
        q.had_consumers = true;
        let conn = self.conn(id);
        conn.channels
            .get_mut(&ch)
            .expect("channel present")
            .consumers
            .insert(tag.clone(), qarc.clone());
        if !c.nowait && !waits {
            conn.amqp.reply(
                ch,
                Reply::BasicConsumeOk {
                    consumer_tag: tag.to_string(),
                },
            );
        }
        self.after_queue_op(&vhost, &qarc);
        Ok(())
    }

    /// Cancels consumer `tag` of channel `ch`; its queue is driven at
    /// once, so that a single-active-consumer queue's next consumer takes
    /// over. Returns whether its `cancel-ok` waits for the queue's master on
    /// another node (unless `nowait`): what the master delivered before the
    /// cancel reaches the client first.
    pub(super) fn cancel(&mut self, id: ConnId, ch: ChannelId, tag: &str, nowait: bool) -> bool {
        if self.cancel_reply_to(id, ch, tag) {
            return false;
        }
        let forwarded = if nowait {
            None
        } else {
            self.forwarded_consumer(id, ch, tag)
        };
        // Held first: the cancel sent to the master keeps the origin's
        // record of the consumer until the master's answer.
        let waits = forwarded.is_some();
        if let Some(f) = forwarded {
            self.hold_cancel_ok((id, ch), tag, f);
        }
        if let Some((vhost, qname)) = self.remove_consumer(id, ch, tag) {
            self.after_queue_op(&vhost, &qname);
        }
        waits
    }

    /// Removes consumer `tag` of channel `ch` from its queue (and from the
    /// queue's master if forwarded); returns the queue, unless it was
    /// auto-deleted, to be driven by the caller.
    pub(super) fn remove_consumer(
        &mut self,
        id: ConnId,
        ch: ChannelId,
        tag: &str,
    ) -> Option<(String, Arc<str>)> {
        let c = self.conn(id);
        let vhost = c.vhost.clone();
        let chan = c.channels.get_mut(&ch)?;
        let qname = chan.consumers.remove(tag)?;
        // What its channel's global prefetch held back for it goes back.
        let held: Vec<u64> = chan
            .held
            .iter()
            .filter(|h| &*h.consumer == tag)
            .map(|h| h.tag)
            .collect();
        if !held.is_empty() {
            chan.held.retain(|h| &*h.consumer != tag);
            self.settle_many(id, ch, &held, Settle::Requeue);
        }
        let mut forwarded = None;
        if let Some(q) = self
            .vhosts
            .get_mut(&vhost)
            .and_then(|v| v.queues.get_mut(&qname))
        {
            if let Some(x) = q
                .consumers
                .iter()
                .find(|x| x.conn == id && x.channel == ch && &*x.tag == tag)
                && let Some(node) = &q.remote
            {
                forwarded = Some((node.clone(), x.remote_cid));
            }
            q.consumers
                .retain(|x| !(x.conn == id && x.channel == ch && &*x.tag == tag));
            q.consumer_left();
            q.last_used_ms = q.last_used_ms.max(self.now);
        }
        if let Some((node, cid)) = forwarded {
            self.link_cancel(&node, &vhost, cid);
        }
        (!self.auto_delete_if_unused(&vhost, &qname)).then_some((vhost, qname))
    }

    pub(super) fn get(
        &mut self,
        id: ConnId,
        ch: ChannelId,
        g: &basic::Get,
    ) -> Result<(), AmqpError> {
        let name = self.queue_name(id, ch, &g.queue)?;
        let qarc = self.queue_arc(id, &name)?;
        self.check(id, Access::Read, "queue", &name)?;
        let vhost = self.conns[&id].vhost.clone();
        let now = self.now;
        let q = self
            .vhosts
            .get_mut(&vhost)
            .and_then(|v| v.queues.get_mut(&qarc))
            .expect("queue present");
        q.last_used_ms = q.last_used_ms.max(now);
        // Between masters, or behind publishes held for the next one: the
        // get waits for that master, after them (a queue held because its
        // own log failed answers at once).
        let held = (q.between_masters() || !q.parked.is_empty())
            && !self
                .failed_logs
                .contains_key(&(vhost.clone(), qarc.clone()));
        let at = match q.remote.clone() {
            _ if held => Some(Elsewhere::Nowhere),
            Some(Elsewhere::Nowhere) => {
                self.conn(id).send_get_empty(ch);
                return Ok(());
            }
            at => at,
        };
        if let Some(node) = at {
            self.link_get(&node, (id, ch), &vhost, &qarc, g.no_ack);
            return Ok(());
        }
        let bq = match &mut q.store {
            Store::Local(bq) => bq,
            Store::Replica(m) => {
                // The answer waits for the ring: a client's further
                // commands wait with it; a link's get keeps its request.
                let c = self.conns.get_mut(&id).expect("connection present");
                let req = c.defer_get();
                if m.fetch(now, FetchForArgs::get(id, ch, g.no_ack, req)) {
                    c.reply_waits();
                } else {
                    c.answering_get(req);
                    c.send_get_empty(ch);
                }
                self.after_queue_op(&vhost, &qarc);
                return Ok(());
            }
        };
        let d = match bq.fetch(now) {
            Ok(d) => d,
            Err(e) if q.dir.is_some() => {
                // The durable queue's log failed a read: held until it opens
                // again, and a held queue's get comes back empty.
                tracing::error!(queue = %name, error = %e, "fetch failed");
                self.fail_log(&vhost, &qarc);
                self.conn(id).send_get_empty(ch);
                return Ok(());
            }
            Err(e) => return Err(err(ReplyCode::InternalError, e.to_string())),
        };
        let Some(d) = d else {
            self.conn(id).send_get_empty(ch);
            self.after_queue_op(&vhost, &qarc);
            return Ok(());
        };
        q.counters.delivered += 1;
        q.counters.redelivered += u64::from(d.redelivered);
        if g.no_ack
            && let Err(e) = bq.ack(d.tag)
        {
            tracing::error!(queue = %name, error = %e, "ack failed");
        }
        let remaining = u32::try_from(bq.stats().ready).unwrap_or(u32::MAX);
        let now = self.now;
        let conn = self.conn(id);
        let chan = conn.channels.get_mut(&ch).expect("channel present");
        chan.next_tag += 1;
        let tag = chan.next_tag;
        if !g.no_ack {
            chan.unacked.insert(
                tag,
                Unacked {
                    queue: qarc.clone(),
                    bq_tag: d.tag,
                    consumer: None,
                    seq: 0,
                    remote: None,
                    delivered_at_ms: now,
                },
            );
        }
        let m = decode_meta(&d.props);
        conn.send_message(
            ch,
            &ContentMethod::GetOk {
                delivery_tag: tag,
                redelivered: d.redelivered,
                exchange: m.exchange,
                routing_key: m.routing_key,
                message_count: remaining,
            },
            &m.properties,
            &d.props,
            &d.body,
        );
        self.after_queue_op(&vhost, &qarc);
        Ok(())
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Settle {
    Ack,
    Requeue,
    Discard,
}

/// Checks, as RabbitMQ does when a transaction's ack, nack or reject
/// arrives (it is applied at `tx.commit`), that `tag` names a delivery
/// awaiting settlement on the channel: 406 if not.
pub(super) fn check_tx_tag(chan: &Channel, tag: u64, multiple: bool) -> Result<(), AmqpError> {
    let known = if multiple {
        tag == 0 || tag == u64::MAX || chan.unacked.range(..=tag).next().is_some()
    } else {
        chan.unacked.contains_key(&tag)
    };
    if known { Ok(()) } else { Err(unknown_tag(tag)) }
}

fn unknown_tag(tag: u64) -> AmqpError {
    err(
        ReplyCode::PreconditionFailed,
        format!("unknown delivery tag {tag}"),
    )
}

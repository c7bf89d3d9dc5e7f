//! Expiry and dead-lettering: the periodic tick (message TTLs, `x-expires`),
//! and re-publishing dropped messages to their queue's dead-letter exchange
//! with RabbitMQ's `x-death` headers.

use warren_amqp::BasicProperties;
use warren_amqp::amq_protocol::types::{AMQPValue, FieldArray, FieldTable, ShortString};
use warren_backing_queue::DropReason;

use super::publish::{route, sender_keys, without_headers};
use super::state::Msg;
use super::{Broker, DEAD_LETTER_DEPTH};
use crate::routing::{Meta, as_i64, as_str, decode_meta, encode_meta};

impl Broker {
    /// Expires messages (`x-message-ttl`, `expiration`) and unused queues
    /// (`x-expires`). Call it every few tens of milliseconds.
    pub fn tick(&mut self, now_ms: u64) {
        self.detached(|b| b.expire(now_ms));
    }

    fn expire(&mut self, now_ms: u64) {
        self.now = now_ms;
        self.current = 0;
        // After a stall (this node's work held up: a slow disk under the
        // lock, an overloaded machine), the clients' input that waited
        // meanwhile — a consume, a declare — goes first: no queue is
        // expired as unused on the tick that ends a stall.
        // (Never two ticks in a row: a node whose every tick is late still
        // expires its queues.)
        let stalled = self.last_tick_ms != 0
            && now_ms.saturating_sub(self.last_tick_ms) > STALL_MS
            && !self.tick_stalled;
        self.tick_stalled = stalled;
        self.last_tick_ms = now_ms;
        self.lazy_sync_due(now_ms);
        self.check_unsynced(now_ms);
        self.expire_remote_alarms(now_ms);
        self.expire_counts(now_ms);
        self.expire_held_gets(now_ms);
        self.expire_consume_oks(now_ms);
        self.expire_cancel_oks(now_ms, None);
        self.time_out_deliveries(now_ms);
        self.peek_masters(now_ms);
        self.unpark_all();
        let mut expire = Vec::new();
        let mut delete = Vec::new();
        let mut left = Vec::new();
        let mut paced = Vec::new();
        for (vname, v) in &mut self.vhosts {
            for q in v.queues.values_mut() {
                // A consumer passed over for being behind may have stopped
                // acking since (`state::Pace`).
                if std::mem::take(&mut q.paced) {
                    paced.push((vname.clone(), q.name.clone()));
                }
                if q.consumer_left_unseen && q.remote.is_none() {
                    left.push((vname.clone(), q.name.clone()));
                }
                if q.store.next_expiry_ms().is_some_and(|t| t < now_ms) {
                    expire.push((vname.clone(), q.name.clone()));
                }
                // Only the node that serves the queue knows every consumer
                // (other nodes' come to it over their links) and every use.
                if let Some(exp) = q.expires_ms
                    && !stalled
                    && q.remote.is_none()
                    && q.consumers.is_empty()
                    && now_ms.saturating_sub(q.last_used_ms) >= exp
                {
                    delete.push((vname.clone(), q.name.clone()));
                }
            }
        }
        for (vname, qname) in expire {
            if let Some(q) = self
                .vhosts
                .get_mut(&vname)
                .and_then(|v| v.queues.get_mut(&qname))
                && let Err(e) = q.store.expire(now_ms)
            {
                tracing::error!(queue = %qname, error = %e, "expiry failed");
            }
            // A mirrored queue's expiries go round its ring now.
            self.mirror_turn(&vname, &qname);
            self.after_queue_op(&vname, &qname);
        }
        for (vname, qname) in delete {
            self.delete_queue(&vname, &qname);
        }
        for (vname, qname) in left {
            self.count_consumer_left(&vname, &qname);
        }
        for (vname, qname) in paced {
            self.after_queue_op(&vname, &qname);
        }
        for (id, c) in &mut self.conns {
            if c.amqp.has_output() {
                c.wake(0, *id);
            }
        }
    }

    pub(super) fn dead_letter(&mut self) {
        if self.dl_depth >= DEAD_LETTER_DEPTH {
            self.dead.clear();
            return;
        }
        self.dl_depth += 1;
        // Oldest first: dead letters keep the order their queue dropped them in.
        while !self.dead.is_empty() {
            for d in std::mem::take(&mut self.dead) {
                let m = decode_meta(&d.meta);
                let reason = match d.reason {
                    DropReason::Expired => "expired",
                    DropReason::MaxLength => "maxlen",
                    DropReason::Rejected => "rejected",
                };
                let mut props = m.properties.clone();
                let mut headers = props.headers().clone().unwrap_or_default();
                let mut deaths: Vec<AMQPValue> = match headers.inner().get("x-death") {
                    Some(AMQPValue::FieldArray(a)) => a.as_slice().to_vec(),
                    _ => Vec::new(),
                };
                // Cycle: the message already died in this queue for this reason
                // without a client rejecting it: drop it, as RabbitMQ does.
                let cycle = deaths.iter().any(|x| match x {
                    AMQPValue::FieldTable(t) => {
                        t.inner().get("queue").and_then(as_str).as_deref() == Some(&*d.queue)
                            && d.reason != DropReason::Rejected
                    }
                    _ => false,
                });
                if cycle {
                    continue;
                }
                // The message died here for this reason before (a cycle
                // with rejections): that entry counts one more and moves to
                // the front, as RabbitMQ's does; it keeps its first time,
                // exchange and routing keys.
                let earlier = deaths.iter().position(|x| match x {
                    AMQPValue::FieldTable(t) => {
                        t.inner().get("queue").and_then(as_str).as_deref() == Some(&*d.queue)
                            && t.inner().get("reason").and_then(as_str).as_deref() == Some(reason)
                    }
                    _ => false,
                });
                let death = match earlier.map(|i| deaths.remove(i)) {
                    Some(AMQPValue::FieldTable(mut t)) => {
                        let count = t.inner().get("count").and_then(as_i64).unwrap_or(0);
                        t.insert("count".into(), AMQPValue::LongLongInt(count + 1));
                        t
                    }
                    _ => {
                        let cc = sender_keys(props.headers().as_ref(), "CC");
                        self.new_death(reason, &d.queue, &m, &cc, props.expiration().as_ref())
                    }
                };
                deaths.insert(0, AMQPValue::FieldTable(death));
                if !headers.contains_key("x-first-death-reason") {
                    headers.insert(
                        "x-first-death-reason".into(),
                        AMQPValue::LongString(reason.into()),
                    );
                    headers.insert(
                        "x-first-death-queue".into(),
                        AMQPValue::LongString((&*d.queue).into()),
                    );
                    headers.insert(
                        "x-first-death-exchange".into(),
                        AMQPValue::LongString(m.exchange.into()),
                    );
                }
                headers.insert("x-death".into(), AMQPValue::FieldArray(deaths.into()));
                props = props.with_headers(headers);
                // RabbitMQ removes the per-message TTL so that it does not expire again.
                props = strip_expiration(props);
                // With the queue's own dead-letter routing key, that key
                // alone: the CC keys go, as RabbitMQ drops them then.
                let rk = match d.routing_key {
                    Some(rk) => {
                        if let Some(p) = without_headers(&props, &["CC", "BCC"]) {
                            props = p;
                        }
                        rk
                    }
                    None => m.routing_key.to_owned(),
                };
                let persistent = props.delivery_mode() == &Some(2);
                let msg = Msg {
                    meta: encode_meta(&d.exchange, &rk, &props),
                    body: d.body,
                    persistent,
                    expiration_ms: None,
                    priority: props.priority().unwrap_or(0),
                    sent: None,
                };
                let mut targets = Vec::new();
                if let Some(v) = self.vhosts.get(&d.vhost) {
                    route(v, &d.exchange, &rk, props.headers().as_ref(), &mut targets);
                }
                if let Err(e) = self.enqueue(&d.vhost, &targets, &msg, None) {
                    tracing::error!(error = %e, "dead-lettering failed");
                }
            }
        }
        self.dl_depth -= 1;
    }
}

impl Broker {
    /// A message's first `x-death` entry for `queue` and `reason`.
    fn new_death(
        &self,
        reason: &str,
        queue: &str,
        m: &Meta<'_>,
        cc: &[String],
        expiration: Option<&ShortString>,
    ) -> FieldTable {
        let mut death = FieldTable::default();
        death.insert("count".into(), AMQPValue::LongLongInt(1));
        death.insert("reason".into(), AMQPValue::LongString(reason.into()));
        death.insert("queue".into(), AMQPValue::LongString(queue.into()));
        death.insert("exchange".into(), AMQPValue::LongString(m.exchange.into()));
        // Its routing key and its CC keys (BCC is gone by now).
        let keys = std::iter::once(m.routing_key)
            .chain(cc.iter().map(String::as_str))
            .map(|k| AMQPValue::LongString(k.into()))
            .collect::<Vec<_>>();
        death.insert(
            "routing-keys".into(),
            AMQPValue::FieldArray(FieldArray::from(keys)),
        );
        death.insert("time".into(), AMQPValue::Timestamp(self.now / 1000));
        if let Some(exp) = expiration {
            // RabbitMQ keeps the per-message TTL the dead letter loses.
            death.insert(
                "original-expiration".into(),
                AMQPValue::LongString(exp.as_str().into()),
            );
        }
        death
    }
}

fn strip_expiration(p: BasicProperties) -> BasicProperties {
    let mut out = BasicProperties::default();
    if let Some(v) = p.content_type() {
        out = out.with_content_type(v.clone());
    }
    if let Some(v) = p.content_encoding() {
        out = out.with_content_encoding(v.clone());
    }
    if let Some(v) = p.headers() {
        out = out.with_headers(v.clone());
    }
    if let Some(v) = p.delivery_mode() {
        out = out.with_delivery_mode(*v);
    }
    if let Some(v) = p.priority() {
        out = out.with_priority(*v);
    }
    if let Some(v) = p.correlation_id() {
        out = out.with_correlation_id(v.clone());
    }
    if let Some(v) = p.reply_to() {
        out = out.with_reply_to(v.clone());
    }
    if let Some(v) = p.message_id() {
        out = out.with_message_id(v.clone());
    }
    if let Some(v) = p.timestamp() {
        out = out.with_timestamp(*v);
    }
    if let Some(v) = p.kind() {
        out = out.with_type(v.clone());
    }
    if let Some(v) = p.user_id() {
        out = out.with_user_id(v.clone());
    }
    if let Some(v) = p.app_id() {
        out = out.with_app_id(v.clone());
    }
    if let Some(v) = p.cluster_id() {
        out = out.with_cluster_id(v.clone());
    }
    out
}

/// A gap between two [`Broker::tick`]s longer than this (they run every
/// 50 ms) is a stall.
const STALL_MS: u64 = 250;

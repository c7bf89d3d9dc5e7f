//! Publishing: routing through the exchanges' bindings, putting a message
//! into its queues (local, mirrored or forwarded), mandatory returns, and
//! publisher confirms.

use std::collections::HashSet;
use std::sync::Arc;

use bytes::Bytes;
use warren_amqp::amq_protocol::protocol::BasicProperties;
use warren_amqp::amq_protocol::types::{AMQPValue, FieldTable};
use warren_amqp::{AmqpError, ChannelId, ContentMethod, Publish, Reply, ReplyCode};
use warren_backing_queue::{DropReason, NewMessage};

use super::args::parse_expiration;
use super::state::{Conn, Dest, IdMap, Msg, Vhost};
use super::{Broker, ConnId, FLOW_TARGETS, Store, TX_COMMIT, err, nack_one, reply_to};
use crate::auth::Access;
use crate::routing::{self, Kind, as_str, encode_meta};

/// Routes a message from exchange `ex` into `out` (queue names): with its
/// routing key and, as RabbitMQ's sender-selected distribution, with each
/// key of its `CC` and `BCC` headers.
pub(super) fn route(
    v: &Vhost,
    ex: &str,
    rk: &str,
    headers: Option<&FieldTable>,
    out: &mut Vec<Arc<str>>,
) {
    let route_key = |key: &str, out: &mut Vec<Arc<str>>| {
        if ex.is_empty() {
            if let Some((k, _)) = v.queues.get_key_value(key) {
                out.push(k.clone());
            }
        } else {
            route_rec(v, ex, key, headers, out, &mut Vec::new());
        }
    };
    route_key(rk, out);
    for name in ["CC", "BCC"] {
        for key in sender_keys(headers, name) {
            route_key(&key, out);
        }
    }
    if out.len() > 1 {
        let mut seen = HashSet::new();
        out.retain(|q| seen.insert(q.clone()));
    }
}

/// The routing keys a message's `CC` or `BCC` header names (its string
/// elements; `check_message` refuses a header that is not an array).
pub(super) fn sender_keys(headers: Option<&FieldTable>, name: &str) -> Vec<String> {
    match headers.and_then(|h| h.inner().get(name)) {
        Some(AMQPValue::FieldArray(a)) => a.as_slice().iter().filter_map(as_str).collect(),
        _ => Vec::new(),
    }
}

/// `props` without the headers `names` (RabbitMQ removes `BCC` before a
/// message is stored, so that no consumer sees it).
pub(super) fn without_headers(props: &BasicProperties, names: &[&str]) -> Option<BasicProperties> {
    let headers = props.headers().as_ref()?;
    if !names.iter().any(|n| headers.inner().contains_key(*n)) {
        return None;
    }
    let mut kept = FieldTable::default();
    for (k, v) in headers.inner() {
        if !names.contains(&k.as_str()) {
            kept.insert(k.clone(), v.clone());
        }
    }
    Some(props.clone().with_headers(kept))
}

fn route_rec<'a>(
    v: &'a Vhost,
    ex: &'a str,
    rk: &str,
    headers: Option<&FieldTable>,
    out: &mut Vec<Arc<str>>,
    visited: &mut Vec<&'a str>,
) {
    if visited.contains(&ex) {
        return;
    }
    visited.push(ex);
    let Some(x) = v.exchanges.get(ex) else {
        return;
    };
    let before = out.len();
    let mut hit = |b: &'a super::state::Binding, out: &mut Vec<Arc<str>>| match &b.dest {
        Dest::Queue(q) => out.push(q.clone()),
        Dest::Exchange(e) => route_rec(v, e, rk, headers, out, visited),
    };
    match x.bindings.matching(x.kind, rk) {
        // Direct and topic: from the exchange's index.
        Some(found) => {
            for b in found.iter().filter_map(|&i| x.bindings.get(i)) {
                hit(b, out);
            }
        }
        None => {
            for b in x.bindings.iter() {
                if x.kind == Kind::Fanout || routing::headers_match(&b.args, headers) {
                    hit(b, out);
                }
            }
        }
    }
    if out.len() == before
        && let Some(ae) = x
            .arguments
            .inner()
            .get("alternate-exchange")
            .and_then(as_str)
        && let Some((ae, _)) = v.exchanges.get_key_value(ae.as_str())
    {
        route_rec(v, ae, rk, headers, out, visited);
    }
}

impl Broker {
    /// RabbitMQ's validated user-id: a message's `user_id` must be the
    /// connection's user, unless that user is tagged `impersonator`.
    fn check_user_id(&self, id: ConnId, props: &BasicProperties) -> Result<(), AmqpError> {
        let Some(claimed) = props.user_id() else {
            return Ok(());
        };
        let c = &self.conns[&id];
        if c.link.is_some() || claimed.as_str() == c.user {
            return Ok(());
        }
        let impersonator = self
            .users
            .get(&c.user)
            .is_some_and(|u| u.tags.iter().any(|t| t == "impersonator"));
        if impersonator {
            return Ok(());
        }
        Err(err(
            ReplyCode::PreconditionFailed,
            format!(
                "user_id property set to '{}' but authenticated user was '{}'",
                claimed.as_str(),
                c.user
            ),
        ))
    }

    /// Puts `msg` into `targets`; returns how many of them owe a group
    /// commit before `confirm` may be acked.
    pub(super) fn enqueue(
        &mut self,
        vhost: &str,
        targets: &[Arc<str>],
        msg: &Msg,
        confirm: Option<(ConnId, ChannelId, u64)>,
    ) -> Result<u32, AmqpError> {
        let mut pending = 0;
        let mut nacks = Vec::new();
        let id = self.next_msg_id;
        self.next_msg_id += 1;
        let mut sync = false;
        for qname in targets {
            let Some(q) = self
                .vhosts
                .get_mut(vhost)
                .and_then(|v| v.queues.get_mut(qname))
            else {
                continue;
            };
            let nm = NewMessage {
                id,
                props: msg.meta.clone(),
                body: msg.body.clone(),
                // Only a durable queue keeps persistent messages; a
                // non-durable one's log (past its budget) is never synced.
                persistent: msg.persistent && q.dir.is_some(),
                expiration_ms: msg.expiration_ms,
                priority: msg.priority,
            };
            // Without a master (or behind publishes held for one): held,
            // in order, for the next master. A queue held because its own
            // log failed refuses them instead.
            let from = match (&q.old_master, confirm) {
                (Some(_), Some((conn, ..))) => super::link::link_origin(&self.conns, conn),
                _ => None,
            };
            if !q.takes_publishes_from(from)
                && !self
                    .failed_logs
                    .contains_key(&(vhost.to_owned(), qname.clone()))
            {
                if self.park(vhost, qname, msg, confirm) {
                    pending += u32::from(confirm.is_some());
                } else if let Some(c) = confirm {
                    pending += 1;
                    nacks.push(c);
                }
                continue;
            }
            if let Some(node) = q.remote.clone() {
                pending += u32::from(self.link_publish(&node, vhost, qname, msg, confirm));
                continue;
            }
            if let Some(r) = q.reject
                && r.full(&q.store.stats())
            {
                // Full with reject-publish: refused, as RabbitMQ's queue
                // does, and dead-lettered with reject-publish-dlx.
                if let Some((conn, ch, cseq)) = confirm {
                    pending += 1;
                    nacks.push((conn, ch, cseq));
                }
                if r.dead_letter {
                    let (meta, body) = (msg.meta.clone(), msg.body.clone());
                    let reason = DropReason::MaxLength;
                    self.dead.extend(q.dead_letter(vhost, reason, meta, body));
                }
                // Sent with an identity (forwarded): noted refused, so that
                // it is not confirmed if it comes again, its nack lost.
                if let Some(sent) = msg.sent
                    && q.note_refused(sent.id())
                {
                    self.mirror_turn(vhost, qname);
                }
                continue;
            }
            if matches!(q.store, Store::Local(_))
                && let Some(sent) = msg.sent
                && !q.take_held(sent)
            {
                // Sent again to a queue served alone here that holds it
                // already, or cannot tell: the publisher hears it may be
                // lost rather than it being taken twice.
                if let Some(c) = confirm {
                    pending += 1;
                    nacks.push(c);
                }
                continue;
            }
            q.counters.published += 1;
            let bq = match &mut q.store {
                Store::Local(bq) => bq,
                Store::Replica(_) => {
                    // The replica's log, if the publish went to it, is
                    // synced when `after_queue_op`'s mirror turn sees it
                    // unsynced: a transient publish wakes no group commit.
                    match self.replica_publish(vhost, qname, nm, confirm, msg.sent) {
                        Ok(owed) => pending += u32::from(owed),
                        Err(e) => {
                            // Cut off from the majority: the replica said so once.
                            if !matches!(e, warren_mirror::MirrorError::Isolated) {
                                tracing::warn!(queue = %qname, error = %e, "a mirrored queue refused a publish");
                            }
                            if let Some((conn, ch, cseq)) = confirm {
                                pending += 1;
                                nacks.push((conn, ch, cseq));
                            }
                        }
                    }
                    self.after_queue_op(vhost, qname);
                    continue;
                }
            };
            match bq.publish(self.now, nm) {
                Ok(p) => {
                    if p.needs_sync {
                        sync = true;
                        if let Some((conn, ch, cseq)) = confirm {
                            q.confirms.push_back((p.seq, conn, ch, cseq));
                            pending += 1;
                        }
                    }
                }
                Err(e) if q.dir.is_some() => {
                    // The durable queue's log failed: this publish and those
                    // waiting for their commit are nacked, the queue held
                    // until its log opens again.
                    tracing::error!(queue = %qname, error = %e, "publish failed");
                    if let Some((conn, ch, cseq)) = confirm {
                        pending += 1;
                        nacks.push((conn, ch, cseq));
                    }
                    self.fail_log(vhost, qname);
                    continue;
                }
                Err(e) => {
                    tracing::error!(queue = %qname, error = %e, "publish failed");
                    return Err(err(
                        ReplyCode::InternalError,
                        format!("queue '{qname}' in vhost '{vhost}' failed to store a message"),
                    ));
                }
            }
            self.after_queue_op(vhost, qname);
        }
        if sync {
            self.want_sync();
        }
        // Refused by a replica (not the master) or a full queue: nacked by
        // the caller once counted as pending.
        self.deferred_nacks.extend(nacks);
        if !self.dead.is_empty() {
            self.dead_letter();
        }
        Ok(pending)
    }

    pub(super) fn publish(
        &mut self,
        id: ConnId,
        ch: ChannelId,
        p: Publish,
    ) -> Result<(), AmqpError> {
        self.conn(id).publisher = true;
        if self.alarmed() {
            // A resource alarm: this publisher is told, and its input waits.
            let reason = self.alarms.cluster().to_string();
            self.conn(id).amqp.block(&reason);
        }
        let vhost = self.conns[&id].vhost.clone();
        let ex = p.exchange.as_str();
        let perm_name = if ex.is_empty() { "amq.default" } else { ex };
        let mut targets = Vec::new();
        {
            let v = self
                .vhosts
                .get(&vhost)
                .ok_or_else(|| AmqpError::vhost_not_found(&vhost))?;
            if !ex.is_empty() {
                let x = v
                    .exchanges
                    .get(ex)
                    .ok_or_else(|| AmqpError::exchange_not_found(ex, &vhost))?;
                if x.internal {
                    return Err(err(
                        ReplyCode::AccessRefused,
                        format!("cannot publish to internal exchange '{ex}' in vhost '{vhost}'"),
                    ));
                }
            }
            self.check(id, Access::Write, "exchange", perm_name)?;
            check_message(&p.properties)?;
            self.check_user_id(id, &p.properties)?;
            route(
                v,
                ex,
                p.routing_key.as_str(),
                p.properties.headers().as_ref(),
                &mut targets,
            );
        }
        // A direct reply-to request names its channel; a reply goes there.
        let addressed = self.address_request(id, ch, &p.properties)?;
        let props = addressed.as_ref().unwrap_or(&p.properties);
        let unseen = without_headers(props, &["BCC"]);
        let props = unseen.as_ref().unwrap_or(props);
        let reply = reply_to::is_reply(ex, p.routing_key.as_str());
        let persistent = p.properties.delivery_mode() == &Some(2);
        let expiration_ms = p
            .properties
            .expiration()
            .as_ref()
            .and_then(|e| parse_expiration(e.as_str()).ok());
        let msg = Msg {
            meta: encode_meta(ex, p.routing_key.as_str(), props),
            body: Bytes::copy_from_slice(&p.body),
            persistent,
            expiration_ms,
            priority: p.properties.priority().unwrap_or(0),
            sent: None,
        };
        let confirm = p.confirm_seq.map(|s| (id, ch, s));
        let pending = self.enqueue(&vhost, &targets, &msg, confirm)?;
        if reply {
            // Delivered, yet not routed: a mandatory reply comes back too
            // (RabbitMQ's documented behaviour: it is not a queue).
            self.route_reply(p.routing_key.as_str(), &msg.meta, &msg.body);
        }
        let now = self.now;
        let c = self.conn(id);
        for t in &targets {
            if !c.targets.contains(t) {
                if c.targets.len() >= FLOW_TARGETS {
                    c.targets.remove(0);
                }
                c.targets.push(t.clone());
            }
        }
        if c.link.is_none() {
            let seq = p.confirm_seq.filter(|s| *s != TX_COMMIT);
            let (routed, mandatory) = (!targets.is_empty(), p.mandatory);
            c.count(ch, |n| n.count_publish(routed, mandatory, seq.is_some()));
            if let Some(seq) = seq
                && let Some(chan) = c.channels.get_mut(&ch)
            {
                chan.confirm_started.insert(seq, now);
            }
        }
        if targets.is_empty() && p.mandatory {
            c.amqp.send_content(
                ch,
                &ContentMethod::Return {
                    reply_code: 312,
                    reply_text: "NO_ROUTE",
                    exchange: ex,
                    routing_key: p.routing_key.as_str(),
                },
                &p.properties,
                &p.body,
            );
        }
        if p.confirm_seq == Some(TX_COMMIT) {
            if let Some(chan) = c.channels.get_mut(&ch) {
                chan.tx_wait += pending;
            }
        } else if let Some(seq) = p.confirm_seq
            && let Some(chan) = c.channels.get_mut(&ch)
        {
            chan.confirm_last = chan.confirm_last.max(seq);
            if pending > 0 {
                chan.confirm_pending.insert(seq, pending);
            }
            if !c.confirm_dirty.contains(&ch) {
                c.confirm_dirty.push(ch);
            }
        }
        for (conn, ch, cseq) in std::mem::take(&mut self.deferred_nacks) {
            nack_one(&mut self.conns, conn, ch, cseq);
        }
        Ok(())
    }
}

impl Conn {
    /// Sends the acks and nacks of publishes settled since the last call;
    /// `now_ms` times the confirms.
    pub(super) fn flush_confirms(&mut self, now_ms: u64) {
        for ch_id in std::mem::take(&mut self.confirm_dirty) {
            let Some(ch) = self.channels.get_mut(&ch_id) else {
                continue;
            };
            let upto = match ch.confirm_pending.first_key_value() {
                Some((k, _)) => k - 1,
                None => ch.confirm_last,
            };
            while let Some(&n) = ch.confirm_nacked.first() {
                if n > upto {
                    break;
                }
                ch.confirm_nacked.pop_first();
                if n > ch.confirm_acked + 1 {
                    self.amqp.reply(
                        ch_id,
                        Reply::Ack {
                            delivery_tag: n - 1,
                            multiple: true,
                        },
                    );
                }
                self.amqp.reply(
                    ch_id,
                    Reply::Nack {
                        delivery_tag: n,
                        multiple: false,
                    },
                );
                ch.confirm_acked = n;
            }
            if upto > ch.confirm_acked {
                ch.confirm_acked = upto;
                self.amqp.reply(
                    ch_id,
                    Reply::Ack {
                        delivery_tag: upto,
                        multiple: true,
                    },
                );
            }
            while let Some(entry) = ch.confirm_started.first_entry() {
                if *entry.key() > ch.confirm_acked {
                    break;
                }
                let at = entry.remove();
                self.counters.confirmed += 1;
                ch.counters.confirmed += 1;
                self.latency.observe(now_ms.saturating_sub(at));
            }
            // Confirmed behind one still pending: acked one by one now, as
            // RabbitMQ does, so that a slow queue does not hold back the
            // confirms of publishes to the others. (A later `multiple` ack
            // may cover them again; clients only settle what is outstanding.)
            let mut done = std::mem::take(&mut ch.confirm_done);
            done.sort_unstable();
            for seq in done {
                if seq <= ch.confirm_acked {
                    continue;
                }
                self.amqp.reply(
                    ch_id,
                    Reply::Ack {
                        delivery_tag: seq,
                        multiple: false,
                    },
                );
                if let Some(at) = ch.confirm_started.remove(&seq) {
                    self.counters.confirmed += 1;
                    ch.counters.confirmed += 1;
                    self.latency.observe(now_ms.saturating_sub(at));
                }
            }
        }
    }
}

/// Answers channel `ch`'s tx.commit, all of whose publishes are settled:
/// commit-ok, or, as RabbitMQ's channel, 406 if one was refused.
pub(super) fn finish_commit(c: &mut Conn, ch: ChannelId) {
    let failed = c
        .channels
        .get_mut(&ch)
        .is_some_and(|chan| std::mem::take(&mut chan.tx_failed));
    if failed {
        c.amqp.channel_error(
            ch,
            err(ReplyCode::PreconditionFailed, "partial tx completion").with_method(90, 20),
        );
        c.woken = true;
        (c.waker)();
    } else {
        c.amqp.reply(ch, Reply::TxCommitOk);
    }
}

pub(super) fn confirm_one(conns: &mut IdMap<ConnId, Conn>, conn: ConnId, ch: ChannelId, cseq: u64) {
    let Some(c) = conns.get_mut(&conn) else {
        return;
    };
    let Some(chan) = c.channels.get_mut(&ch) else {
        return;
    };
    if cseq == TX_COMMIT {
        chan.tx_wait = chan.tx_wait.saturating_sub(1);
        if chan.tx_wait == 0 {
            finish_commit(c, ch);
        }
    } else if let Some(n) = chan.confirm_pending.get_mut(&cseq) {
        *n -= 1;
        if *n == 0 {
            chan.confirm_pending.remove(&cseq);
            if c.link_confirmed(cseq, true) {
                return;
            }
            if let Some(chan) = c.channels.get_mut(&ch) {
                chan.confirm_done.push(cseq);
            }
        }
    }
    if !c.confirm_dirty.contains(&ch) {
        c.confirm_dirty.push(ch);
    }
}

/// What RabbitMQ's channel refuses in a message's properties before it
/// routes it: an expiration that is not a whole number of ms up to ten
/// years, and `CC` / `BCC` headers that are not arrays.
fn check_message(props: &BasicProperties) -> Result<(), AmqpError> {
    if let Some(e) = props.expiration() {
        parse_expiration(e.as_str()).map_err(|why| {
            err(
                ReplyCode::PreconditionFailed,
                format!("invalid expiration '{}': {why}", e.as_str()),
            )
        })?;
    }
    if let Some(headers) = props.headers() {
        for name in ["CC", "BCC"] {
            match headers.inner().get(name) {
                None | Some(AMQPValue::FieldArray(_)) => {}
                Some(v) => {
                    return Err(err(
                        ReplyCode::PreconditionFailed,
                        format!(
                            "invalid message: {{unacceptable_type_in_header,\"{name}\",{}}}",
                            routing::type_name(v)
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

//! RabbitMQ's direct reply-to: a channel consuming the pseudo-queue
//! `amq.rabbitmq.reply-to` (no acks) may publish requests whose `reply_to`
//! is that name; the broker gives each one a `reply_to` naming the channel
//! (`amq.rabbitmq.reply-to.<token>`), and a reply published to the default
//! exchange with that routing key goes straight to the channel's consumer,
//! with no queue, from any node of the cluster.

use std::sync::Arc;

use bytes::Bytes;
use warren_amqp::amq_protocol::protocol::{BasicProperties, basic};
use warren_amqp::{AmqpError, ChannelId, ContentMethod, Reply, ReplyCode};

use super::link::LinkMsg;
use super::{Broker, ConnId, err, random_name};
use crate::routing::decode_meta;

/// The pseudo-queue a requester consumes and names as `reply_to`.
pub(super) const REPLY_TO: &str = "amq.rabbitmq.reply-to";

/// What a reply's routing key starts with: `REPLY_TO` and a dot.
const REPLY_PREFIX: &str = "amq.rabbitmq.reply-to.";

/// A channel's direct reply-to consumer.
#[derive(Debug, Clone)]
pub(super) struct ReplyConsumer {
    /// Its consumer tag.
    pub(super) tag: Arc<str>,
    /// A random key in its address, so that one cannot be guessed.
    pub(super) key: String,
}

/// Where a reply goes: the node, connection and channel, and the channel's key.
struct Address<'a> {
    node: String,
    conn: ConnId,
    channel: ChannelId,
    key: &'a str,
}

/// `REPLY_PREFIX` + node (hex) `.` connection `.` channel `.` key.
fn address(node: &str, conn: ConnId, channel: ChannelId, key: &str) -> String {
    let hex: String = node.bytes().map(|b| format!("{b:02x}")).collect();
    format!("{REPLY_PREFIX}{hex}.{conn}.{channel}.{key}")
}

fn parse(routing_key: &str) -> Option<Address<'_>> {
    let rest = routing_key.strip_prefix(REPLY_PREFIX)?;
    let mut parts = rest.split('.');
    let hex = parts.next()?;
    let conn = parts.next()?.parse().ok()?;
    let channel = parts.next()?.parse().ok()?;
    let key = parts.next()?;
    if parts.next().is_some() || hex.len() % 2 != 0 {
        return None;
    }
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    Some(Address {
        node: String::from_utf8(bytes).ok()?,
        conn,
        channel,
        key,
    })
}

/// Whether a publish to the default exchange with `routing_key` is a reply.
pub(super) fn is_reply(exchange: &str, routing_key: &str) -> bool {
    exchange.is_empty() && routing_key.starts_with(REPLY_PREFIX)
}

impl Broker {
    /// `basic.consume` of `amq.rabbitmq.reply-to` on channel `ch`: no acks,
    /// one per channel (RabbitMQ's refusals and texts).
    pub(super) fn consume_reply_to(
        &mut self,
        id: ConnId,
        ch: ChannelId,
        c: &basic::Consume,
    ) -> Result<(), AmqpError> {
        let conn = self.conn(id);
        let chan = conn.channels.get_mut(&ch).expect("channel present");
        let tag = c.consumer_tag.as_str();
        if chan.consumers.contains_key(tag) {
            return Err(err(
                ReplyCode::NotAllowed,
                format!("attempt to reuse consumer tag '{tag}'"),
            ));
        }
        if !c.no_ack {
            return Err(err(
                ReplyCode::PreconditionFailed,
                "reply consumer cannot acknowledge".to_owned(),
            ));
        }
        if chan.reply_consumer.is_some() {
            return Err(err(
                ReplyCode::PreconditionFailed,
                "reply consumer already set".to_owned(),
            ));
        }
        let tag: Arc<str> = if tag.is_empty() {
            random_name("amq.ctag-").into()
        } else {
            tag.into()
        };
        // Letters and digits only: the key is the address's last part.
        let key: String = random_name("")
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .collect();
        chan.reply_consumer = Some(ReplyConsumer {
            tag: tag.clone(),
            key,
        });
        if !c.nowait {
            conn.amqp.reply(
                ch,
                Reply::BasicConsumeOk {
                    consumer_tag: tag.to_string(),
                },
            );
        }
        Ok(())
    }

    /// Cancels channel `ch`'s direct reply-to consumer if its tag is `tag`;
    /// whether it was.
    pub(super) fn cancel_reply_to(&mut self, id: ConnId, ch: ChannelId, tag: &str) -> bool {
        let Some(chan) = self.conn(id).channels.get_mut(&ch) else {
            return false;
        };
        if chan.reply_consumer.as_ref().is_some_and(|r| &*r.tag == tag) {
            chan.reply_consumer = None;
            return true;
        }
        false
    }

    /// The properties of a request published on channel `ch` whose
    /// `reply_to` is `amq.rabbitmq.reply-to`: that replaced by the
    /// channel's address. Refused (406) without a reply consumer.
    pub(super) fn address_request(
        &mut self,
        id: ConnId,
        ch: ChannelId,
        props: &BasicProperties,
    ) -> Result<Option<BasicProperties>, AmqpError> {
        if props.reply_to().as_ref().map(|r| r.as_str()) != Some(REPLY_TO) {
            return Ok(None);
        }
        let node = self.cfg.node_name.clone();
        let chan = self.conn(id).channels.get(&ch).expect("channel present");
        let Some(rc) = &chan.reply_consumer else {
            return Err(err(
                ReplyCode::PreconditionFailed,
                "fast reply consumer does not exist".to_owned(),
            ));
        };
        let to = address(&node, id, ch, &rc.key);
        Ok(Some(props.clone().with_reply_to(to.into())))
    }

    /// A reply published to `routing_key` (see [`is_reply`]): delivered to
    /// the requesting channel here, or sent to its node (a cluster member's
    /// only); dropped if it names no channel.
    pub(super) fn route_reply(&mut self, routing_key: &str, meta: &Bytes, body: &Bytes) {
        let Some(to) = parse(routing_key) else {
            return;
        };
        if to.node == self.cfg.node_name {
            self.deliver_reply_at(&to, meta, body);
            return;
        }
        if !self.meta.is_member(&to.node) {
            return;
        }
        let msg = LinkMsg::Reply {
            to: routing_key.to_owned(),
            meta: meta.clone(),
            body: body.clone(),
        };
        self.links.send(&to.node, msg);
    }

    /// Whether `queue.declare` of `name` finds a direct reply-to queue:
    /// `None` if `name` is not one; the pseudo-queue itself always exists,
    /// a channel's address while that channel consumes it here (or, on
    /// another member, while that member is one: replies still go there).
    pub(super) fn reply_to_exists(&self, name: &str) -> Option<bool> {
        if name == REPLY_TO {
            return Some(true);
        }
        if !name.starts_with(REPLY_PREFIX) {
            return None;
        }
        let Some(to) = parse(name) else {
            return Some(false);
        };
        if to.node != self.cfg.node_name {
            return Some(self.meta.is_member(&to.node));
        }
        let live = self
            .conns
            .get(&to.conn)
            .and_then(|c| c.channels.get(&to.channel))
            .and_then(|chan| chan.reply_consumer.as_ref())
            .is_some_and(|r| r.key == to.key);
        Some(live)
    }

    /// Delivers a reply to the channel `routing_key` names on this node;
    /// nothing if that channel or its reply consumer is gone.
    pub(super) fn deliver_reply(&mut self, routing_key: &str, meta: &Bytes, body: &Bytes) {
        if let Some(to) = parse(routing_key) {
            self.deliver_reply_at(&to, meta, body);
        }
    }

    /// [`Self::deliver_reply`] to an address already parsed.
    fn deliver_reply_at(&mut self, to: &Address<'_>, meta: &Bytes, body: &Bytes) {
        let current = self.current;
        let Some(c) = self.conns.get_mut(&to.conn) else {
            return;
        };
        let Some(chan) = c.channels.get_mut(&to.channel) else {
            return;
        };
        let Some(rc) = chan.reply_consumer.as_ref().filter(|r| r.key == to.key) else {
            return;
        };
        let tag = rc.tag.clone();
        chan.next_tag += 1;
        let delivery_tag = chan.next_tag;
        let m = decode_meta(meta);
        c.count_delivery(to.channel, false);
        c.amqp.send_content(
            to.channel,
            &ContentMethod::Deliver {
                consumer_tag: &tag,
                delivery_tag,
                redelivered: false,
                exchange: m.exchange,
                routing_key: m.routing_key,
            },
            &m.properties,
            body,
        );
        c.wake(current, to.conn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_names_its_node_connection_channel_and_key() {
        let a = address("warren@a.b", 7, 3, "k3Y");
        assert!(a.starts_with(REPLY_PREFIX));
        let p = parse(&a).unwrap();
        assert_eq!(
            (p.node.as_str(), p.conn, p.channel, p.key),
            ("warren@a.b", 7, 3, "k3Y")
        );
        for bad in [
            "amq.rabbitmq.reply-to.nothing",
            "amq.rabbitmq.reply-to.7a.1.2",
            "amq.rabbitmq.reply-to.7.1.2.k",
            "amq.rabbitmq.reply-to.7a.x.2.k",
            "amq.rabbitmq.reply-to.7a.1.2.k.more",
            "reply-to.7a.1.2.k",
        ] {
            assert!(parse(bad).is_none(), "{bad}");
        }
    }
}

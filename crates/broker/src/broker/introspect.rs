//! Read-only views of the broker for the management API and `warrenctl`,
//! plus the few administrative operations they need (delete a vhost, user,
//! queue; purge; declare from a definitions file; store policies).
//!
//! A child module of `broker` so it can read the broker's state without
//! widening its fields.

use std::path::Path;
use std::sync::Arc;

use serde_json::{Map, Value};
use warren_amqp::Mechanism;
use warren_amqp::amq_protocol::types::{AMQPValue, FieldArray, FieldTable, ShortString};

use super::link::QueueFigures;
use super::stats::{MessageCounters, Octets, QueueCounters};
use super::{
    Binding, Broker, Dest, Elsewhere, Exchange, OWNER_ELSEWHERE, QueueOpts, ReplyCode, Scope, err,
    new_vhost, valid_name,
};
use crate::BrokerError;
use crate::auth::{PermissionDef, UserDef};
use crate::meta::{BindingDef, Change, ExchangeDef, PolicyDef, QueueDef};
use crate::routing::Kind;

/// One queue as the management API lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueInfo {
    /// Its vhost.
    pub vhost: String,
    /// Its name.
    pub name: String,
    /// Survives a restart.
    pub durable: bool,
    /// Deleted when its last consumer goes.
    pub auto_delete: bool,
    /// Owned by one connection.
    pub exclusive: bool,
    /// Declare arguments, as JSON.
    pub arguments: Value,
    /// Messages ready for delivery.
    pub messages_ready: u64,
    /// Messages delivered and not yet acked.
    pub messages_unacknowledged: u64,
    /// Bytes of the ready messages.
    pub message_bytes_ready: u64,
    /// Bytes of the unacked messages.
    pub message_bytes_unacknowledged: u64,
    /// Consumers attached.
    pub consumers: u64,
    /// A stable id (`<node.uid>`), standing in for RabbitMQ's pid.
    pub uid: u64,
    /// The owning connection of an exclusive queue, if of this node.
    pub owner: Option<u64>,
    /// Its traffic, counted where it is served.
    pub counters: QueueCounters,
    /// This node serves it (it is not forwarded to another node's master):
    /// `counters` are the queue's.
    pub served_here: bool,
    /// Its ring, when mirrored.
    pub ring: Option<RingInfo>,
    /// Its log failed (a full or failing disk): held, its messages not
    /// known, until its log opens again ([`Broker::failed_logs`]).
    pub log_failed: bool,
}

/// A mirrored queue's ring as this node's replica sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingInfo {
    /// The view version (epoch).
    pub view: u64,
    /// Publishes and fetches sent around the ring and not yet held by every
    /// member (GM's pending buffer).
    pub pending: u64,
}

/// One exchange as the management API lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct ExchangeInfo {
    /// Its vhost.
    pub vhost: String,
    /// Its name (`""` is the default exchange).
    pub name: String,
    /// direct, fanout, topic or headers.
    pub kind: String,
    /// Survives a restart.
    pub durable: bool,
    /// Deleted when its last binding goes.
    pub auto_delete: bool,
    /// Clients may not publish to it.
    pub internal: bool,
    /// Declare arguments, as JSON.
    pub arguments: Value,
}

/// One binding as the management API lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct BindingInfo {
    /// Its vhost.
    pub vhost: String,
    /// The source exchange (`""` for the default exchange's implicit bindings).
    pub source: String,
    /// The destination's name.
    pub destination: String,
    /// `queue` or `exchange`.
    pub destination_type: &'static str,
    /// The binding key.
    pub routing_key: String,
    /// Binding arguments, as JSON.
    pub arguments: Value,
}

/// One client connection.
#[derive(Debug, Clone, PartialEq)]
pub struct ConnectionInfo {
    /// The broker's id of the connection.
    pub id: u64,
    /// The client's address.
    pub peer: std::net::SocketAddr,
    /// The TLS version it speaks (`tlsv1.3`); None over plain TCP.
    pub tls: Option<&'static str>,
    /// The user it logged in as (empty before login).
    pub user: String,
    /// Its vhost (empty before `connection.open`).
    pub vhost: String,
    /// Open channels.
    pub channels: u64,
    /// Bytes read from and written to its socket.
    pub octets: Octets,
    /// The client's connection.start-ok properties, as JSON.
    pub client_properties: Value,
    /// The SASL mechanism it logged in with (`None` before start-ok).
    pub auth_mechanism: Option<&'static str>,
}

/// One channel of a client connection.
#[derive(Debug, Clone, PartialEq)]
pub struct ChannelInfo {
    /// The broker's id of its connection.
    pub conn: u64,
    /// The channel number.
    pub number: u16,
    /// `basic.qos` prefetch count per consumer.
    pub prefetch: u16,
    /// `basic.qos` prefetch count shared by the channel (`global`).
    pub global_prefetch: u16,
    /// In confirm mode.
    pub confirm: bool,
    /// In a transaction (`tx.select`).
    pub transactional: bool,
    /// Consumers on it.
    pub consumers: u64,
    /// Deliveries not yet acked.
    pub unacked: u64,
    /// Publishes not yet confirmed.
    pub unconfirmed: u64,
    /// Its client traffic so far.
    pub counters: MessageCounters,
}

/// One consumer.
#[derive(Debug, Clone, PartialEq)]
pub struct ConsumerInfo {
    /// The queue's vhost.
    pub vhost: String,
    /// The queue.
    pub queue: String,
    /// The consumer tag.
    pub tag: String,
    /// The connection it belongs to.
    pub conn: u64,
    /// The channel it belongs to.
    pub channel: u16,
    /// Deliveries must be acked.
    pub ack_required: bool,
    /// An exclusive consumer.
    pub exclusive: bool,
    /// The channel's prefetch count.
    pub prefetch: u16,
    /// Its `x-priority` (0 without the argument).
    pub priority: i32,
    /// Whether it gets messages: false for one waiting on a
    /// single-active-consumer queue; `None` where this node cannot tell (a
    /// single-active-consumer queue served on another node decides there).
    pub active: Option<bool>,
    /// Its queue has a single active consumer.
    pub single_active: bool,
}

/// Converts an AMQP field value to JSON (as the management API shows arguments).
pub fn amqp_to_json(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(n) => Value::from(*n),
        AMQPValue::ShortShortUInt(n) => Value::from(*n),
        AMQPValue::ShortInt(n) => Value::from(*n),
        AMQPValue::ShortUInt(n) => Value::from(*n),
        AMQPValue::LongInt(n) => Value::from(*n),
        AMQPValue::LongUInt(n) => Value::from(*n),
        AMQPValue::LongLongInt(n) => Value::from(*n),
        AMQPValue::Timestamp(n) => Value::from(*n),
        AMQPValue::Float(f) => Value::from(f64::from(*f)),
        AMQPValue::Double(f) => Value::from(*f),
        AMQPValue::DecimalValue(d) => {
            Value::from(f64::from(d.value) / 10f64.powi(i32::from(d.scale)))
        }
        AMQPValue::ShortString(s) => Value::String(s.as_str().to_owned()),
        AMQPValue::LongString(s) => Value::String(String::from_utf8_lossy(s.as_bytes()).into()),
        AMQPValue::ByteArray(b) => Value::String(format!("{b:?}")),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(amqp_to_json).collect()),
        AMQPValue::FieldTable(t) => table_to_json(t),
        AMQPValue::Void => Value::Null,
    }
}

/// Converts a field table to a JSON object.
pub fn table_to_json(t: &FieldTable) -> Value {
    let mut m = Map::new();
    for (k, v) in t.inner() {
        m.insert(k.as_str().to_owned(), amqp_to_json(v));
    }
    Value::Object(m)
}

/// Converts JSON (a definitions file's `arguments`) to an AMQP field value.
pub fn json_to_amqp(v: &Value) -> AMQPValue {
    match v {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64().unwrap_or(0.0)),
        },
        Value::String(s) => AMQPValue::LongString(s.as_str().into()),
        Value::Array(a) => AMQPValue::FieldArray(FieldArray::from(
            a.iter().map(json_to_amqp).collect::<Vec<_>>(),
        )),
        Value::Object(_) => AMQPValue::FieldTable(json_to_table(v)),
    }
}

/// Converts a JSON object to a field table (anything else gives an empty table).
pub fn json_to_table(v: &Value) -> FieldTable {
    let mut t = FieldTable::default();
    if let Value::Object(m) = v {
        for (k, x) in m {
            t.insert(ShortString::from(k.as_str()), json_to_amqp(x));
        }
    }
    t
}

fn missing(what: &str, name: &str, vhost: &str) -> BrokerError {
    BrokerError::Invalid(format!("no {what} '{name}' in vhost '{vhost}'"))
}

impl Broker {
    /// The time of the broker's latest input, in the shell's clock: for an
    /// in-process client that has no clock of its own.
    #[must_use]
    pub fn now_ms(&self) -> u64 {
        self.now
    }

    /// The node's name.
    #[must_use]
    pub fn node_name(&self) -> &str {
        &self.cfg.node_name
    }

    /// The product name and version the node gives clients and operators
    /// (`product.name`, `product.version`; by default Warren's).
    #[must_use]
    pub fn product(&self) -> (&str, &str) {
        (&self.cfg.amqp.product, &self.cfg.amqp.version)
    }

    /// The node's data directory.
    #[must_use]
    pub fn data_dir(&self) -> &Path {
        &self.cfg.data_dir
    }

    /// Vhost names, sorted.
    #[must_use]
    pub fn vhost_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.vhosts.keys().cloned().collect();
        v.sort();
        v
    }

    /// Whether `vhost` exists.
    #[must_use]
    pub fn has_vhost(&self, vhost: &str) -> bool {
        self.vhosts.contains_key(vhost)
    }

    /// Whether queue `name` exists in `vhost` (a lookup, where
    /// [`queues`](Self::queues) describes every queue).
    #[must_use]
    pub fn has_queue(&self, vhost: &str, name: &str) -> bool {
        self.vhosts
            .get(vhost)
            .is_some_and(|v| v.queues.contains_key(name))
    }

    /// Users, sorted by name.
    #[must_use]
    pub fn users(&self) -> Vec<UserDef> {
        let mut v: Vec<UserDef> = self.users.values().cloned().collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// One user.
    #[must_use]
    pub fn user(&self, name: &str) -> Option<&UserDef> {
        self.users.get(name)
    }

    /// Every permission, sorted by vhost then user.
    #[must_use]
    pub fn permissions(&self) -> Vec<PermissionDef> {
        let mut v: Vec<PermissionDef> = self
            .vhosts
            .values()
            .flat_map(|v| v.permissions.values().cloned())
            .collect();
        v.sort_by(|a, b| (&a.vhost, &a.user).cmp(&(&b.vhost, &b.user)));
        v
    }

    /// Every queue's vhost, name and whether it is exclusive to a
    /// connection of this node, cheaply (no figures, arguments or
    /// policies): for comparing with the cluster's.
    #[must_use]
    pub fn queue_names(&self) -> Vec<(String, String, bool)> {
        self.vhosts
            .iter()
            .flat_map(|(vn, v)| {
                v.queues.values().map(move |q| {
                    let own = q.owned_here();
                    (vn.clone(), q.name.to_string(), own)
                })
            })
            .collect()
    }

    /// Every queue (of `vhost`, or of all vhosts), sorted by vhost then name.
    #[must_use]
    pub fn queues(&self, vhost: Option<&str>) -> Vec<QueueInfo> {
        let mut out = Vec::new();
        for (vn, v) in &self.vhosts {
            if vhost.is_some_and(|x| x != vn) {
                continue;
            }
            for q in v.queues.values() {
                // Served elsewhere: the master's figures, as every RabbitMQ
                // node shows a queue's (this node's copy may lag or be empty).
                // A synchronised mirror's copy is the master's, and fresher
                // than the last figures asked for (its consumers are not).
                let local = q.figures();
                let synchronised = q.store.mirror_status().is_some_and(|m| m.synchronised);
                let f = match (&q.remote, q.remote_figures) {
                    (Some(_), Some(r)) if synchronised => QueueFigures {
                        consumers: r.consumers,
                        ..local
                    },
                    (Some(_), Some(r)) => r,
                    _ => local,
                };
                out.push(QueueInfo {
                    vhost: vn.clone(),
                    name: q.name.to_string(),
                    durable: q.opts.durable,
                    auto_delete: q.opts.auto_delete,
                    exclusive: q.opts.exclusive,
                    arguments: table_to_json(&q.opts.arguments),
                    messages_ready: f.ready,
                    messages_unacknowledged: f.unacked,
                    message_bytes_ready: f.ready_bytes,
                    message_bytes_unacknowledged: f.unacked_bytes,
                    consumers: f.consumers,
                    uid: q.uid,
                    // Another node's connection: its id is that node's.
                    owner: q.owner.filter(|&o| o != OWNER_ELSEWHERE),
                    counters: q.counters,
                    served_here: q.remote.is_none(),
                    ring: q.store.ring(),
                    log_failed: self.failed_logs.get(&(vn.clone(), q.name.clone())) == Some(&q.uid),
                });
            }
        }
        out.sort_by(|a, b| (&a.vhost, &a.name).cmp(&(&b.vhost, &b.name)));
        out
    }

    /// Every exchange (of `vhost`, or of all), including the default one.
    #[must_use]
    pub fn exchanges(&self, vhost: Option<&str>) -> Vec<ExchangeInfo> {
        let mut out = Vec::new();
        for (vn, v) in &self.vhosts {
            if vhost.is_some_and(|x| x != vn) {
                continue;
            }
            out.push(ExchangeInfo {
                vhost: vn.clone(),
                name: String::new(),
                kind: "direct".into(),
                durable: true,
                auto_delete: false,
                internal: false,
                arguments: Value::Object(Map::new()),
            });
            for (xn, x) in &v.exchanges {
                out.push(ExchangeInfo {
                    vhost: vn.clone(),
                    name: xn.clone(),
                    kind: x.kind.as_str().to_owned(),
                    durable: x.durable,
                    auto_delete: x.auto_delete,
                    internal: x.internal,
                    arguments: table_to_json(&x.arguments),
                });
            }
        }
        out.sort_by(|a, b| (&a.vhost, &a.name).cmp(&(&b.vhost, &b.name)));
        out
    }

    /// Every binding (of `vhost`, or of all), the default exchange's
    /// implicit ones first, as RabbitMQ lists them.
    #[must_use]
    pub fn bindings(&self, vhost: Option<&str>) -> Vec<BindingInfo> {
        let mut out = Vec::new();
        let mut vhosts: Vec<&String> = self.vhosts.keys().collect();
        vhosts.sort();
        for vn in vhosts {
            if vhost.is_some_and(|x| x != vn) {
                continue;
            }
            let v = &self.vhosts[vn];
            let mut qs: Vec<&Arc<str>> = v.queues.keys().collect();
            qs.sort();
            for q in qs {
                out.push(BindingInfo {
                    vhost: vn.clone(),
                    source: String::new(),
                    destination: q.to_string(),
                    destination_type: "queue",
                    routing_key: q.to_string(),
                    arguments: Value::Object(Map::new()),
                });
            }
            let mut xs: Vec<(&String, &Exchange)> = v.exchanges.iter().collect();
            xs.sort_by(|a, b| a.0.cmp(b.0));
            for (xn, x) in xs {
                for b in &x.bindings {
                    let (destination, destination_type) = match &b.dest {
                        Dest::Queue(q) => (q.to_string(), "queue"),
                        Dest::Exchange(e) => (e.clone(), "exchange"),
                    };
                    out.push(BindingInfo {
                        vhost: vn.clone(),
                        source: xn.clone(),
                        destination,
                        destination_type,
                        routing_key: b.key.clone(),
                        arguments: table_to_json(&b.args),
                    });
                }
            }
        }
        out
    }

    /// Open client connections (not the forwarding links of other nodes),
    /// by id.
    #[must_use]
    pub fn connections(&self) -> Vec<ConnectionInfo> {
        let mut out: Vec<ConnectionInfo> = self
            .conns
            .iter()
            .filter(|(_, c)| c.link.is_none())
            .map(|(id, c)| ConnectionInfo {
                id: *id,
                peer: c.peer,
                tls: c.tls,
                user: c.user.clone(),
                vhost: c.vhost.clone(),
                channels: c.channels.len() as u64,
                octets: c.octets,
                client_properties: table_to_json(c.amqp.client_properties()),
                auth_mechanism: c.amqp.mechanism().map(Mechanism::as_str),
            })
            .collect();
        out.sort_by_key(|c| c.id);
        out
    }

    /// The channels of open client connections, by connection id and
    /// channel number.
    #[must_use]
    pub fn channels(&self) -> Vec<ChannelInfo> {
        let mut out: Vec<ChannelInfo> = self
            .conns
            .iter()
            .filter(|(_, c)| c.link.is_none())
            .flat_map(|(id, c)| {
                c.channels.iter().map(|(n, ch)| ChannelInfo {
                    conn: *id,
                    number: *n,
                    prefetch: ch.prefetch,
                    global_prefetch: ch.global_prefetch,
                    confirm: ch.confirm,
                    transactional: ch.tx.is_some(),
                    consumers: ch.consumers.len() as u64,
                    unacked: ch.unacked.len() as u64,
                    unconfirmed: ch.confirm_started.len() as u64,
                    counters: ch.counters,
                })
            })
            .collect();
        out.sort_by_key(|c| (c.conn, c.number));
        out
    }

    /// Every consumer (of `vhost`, or of all) of this node's client
    /// connections (one forwarded here is listed on its client's node).
    #[must_use]
    pub fn consumers(&self, vhost: Option<&str>) -> Vec<ConsumerInfo> {
        let mut out = Vec::new();
        for (vn, v) in &self.vhosts {
            if vhost.is_some_and(|x| x != vn) {
                continue;
            }
            for q in v.queues.values() {
                let client = |c: &&super::Consumer| {
                    self.conns.get(&c.conn).is_some_and(|c| c.link.is_none())
                };
                let holder = q.active_index();
                for (i, c) in q.consumers.iter().enumerate() {
                    if !client(&c) {
                        continue;
                    }
                    let active = if !q.single_active {
                        Some(true)
                    } else if q.remote.is_some() {
                        None
                    } else {
                        Some(holder == Some(i))
                    };
                    out.push(ConsumerInfo {
                        vhost: vn.clone(),
                        queue: q.name.to_string(),
                        tag: c.tag.to_string(),
                        conn: c.conn,
                        channel: c.channel,
                        ack_required: !c.no_ack,
                        exclusive: c.exclusive,
                        prefetch: c.prefetch,
                        priority: c.priority,
                        active,
                        single_active: q.single_active,
                    });
                }
            }
        }
        out.sort_by(|a, b| (&a.vhost, &a.queue, &a.tag).cmp(&(&b.vhost, &b.queue, &b.tag)));
        out
    }

    /// Deletes a vhost with its queues, exchanges, permissions and policies;
    /// connections to it are closed. False if there was none.
    pub fn delete_vhost(&mut self, name: &str) -> Result<bool, BrokerError> {
        if !self.vhosts.contains_key(name) {
            return Ok(false);
        }
        let queues: Vec<Arc<str>> = self.vhosts[name].queues.keys().cloned().collect();
        self.current = 0;
        for q in queues {
            self.delete_queue(name, &q);
        }
        let ids: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| c.vhost == name)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if let Some(c) = self.conns.get_mut(&id) {
                c.amqp
                    .connection_error(err(ReplyCode::ConnectionForced, "vhost deleted"));
                c.woken = true;
                (c.waker)();
            }
        }
        self.store_change(Change::DeleteVhost(name.to_owned()))?;
        self.vhosts.remove(name);
        Ok(true)
    }

    /// Deletes a user and their permissions. False if there was none.
    pub fn delete_user(&mut self, name: &str) -> Result<bool, BrokerError> {
        if !self.users.contains_key(name) {
            return Ok(false);
        }
        self.store_change(Change::DeleteUser(name.to_owned()))?;
        self.users.remove(name);
        for v in self.vhosts.values_mut() {
            v.permissions.remove(name);
        }
        Ok(true)
    }

    /// Clears a user's permissions in a vhost. False if there were none.
    pub fn clear_permissions(&mut self, user: &str, vhost: &str) -> Result<bool, BrokerError> {
        if !self
            .vhosts
            .get(vhost)
            .is_some_and(|v| v.permissions.contains_key(user))
        {
            return Ok(false);
        }
        self.store_change(Change::DeletePermission {
            user: user.to_owned(),
            vhost: vhost.to_owned(),
        })?;
        if let Some(v) = self.vhosts.get_mut(vhost) {
            v.permissions.remove(user);
        }
        Ok(true)
    }

    /// Deletes a queue (its consumers get a `basic.cancel`); the number of
    /// ready messages it had, or `None` if there was no such queue.
    pub fn admin_delete_queue(&mut self, vhost: &str, name: &str) -> Option<u32> {
        let exists = self
            .vhosts
            .get(vhost)
            .is_some_and(|v| v.queues.contains_key(name));
        if !exists {
            return None;
        }
        self.current = 0;
        Some(self.delete_queue(vhost, name))
    }

    /// Purges a queue's ready messages; how many, or an error if there is
    /// no such queue.
    pub fn admin_purge_queue(&mut self, vhost: &str, name: &str) -> Result<u64, BrokerError> {
        let q = self
            .vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(name))
            .ok_or_else(|| missing("queue", name, vhost))?;
        let n = q.store.purge().map_err(BrokerError::Invalid)?;
        self.mirror_turn(vhost, name);
        Ok(n)
    }

    /// Declares a queue as a definitions file, the management API or the
    /// cluster's replay does (no owner). An existing queue is left as it
    /// is. Any valid name is taken, `amq.` ones too: a server-named queue
    /// (`amq.gen-…`) that a client of another node declared is replayed
    /// here (the management API refuses those names itself).
    pub fn admin_declare_queue(
        &mut self,
        vhost: &str,
        name: &str,
        durable: bool,
        auto_delete: bool,
        arguments: FieldTable,
    ) -> Result<(), BrokerError> {
        let Some(v) = self.vhosts.get(vhost) else {
            return Err(BrokerError::Invalid(format!("no vhost '{vhost}'")));
        };
        if v.queues.contains_key(name) {
            return Ok(());
        }
        if name.is_empty() {
            return Err(BrokerError::Invalid("queue name is empty".into()));
        }
        valid_name("queue", name)?;
        valid_name("vhost", vhost)?;
        let opts = QueueOpts {
            durable,
            exclusive: false,
            auto_delete,
            arguments: arguments.clone(),
        };
        let qname: Arc<str> = Arc::from(name);
        let queue = self.make_queue(vhost, qname.clone(), opts, None)?;
        self.record(
            Scope::of_queue(&queue.opts),
            Change::PutQueue(QueueDef {
                vhost: vhost.to_owned(),
                name: name.to_owned(),
                durable,
                master: None,
                auto_delete,
                exclusive: false,
                arguments,
            }),
        )?;
        if let Some(v) = self.vhosts.get_mut(vhost) {
            v.queues.insert(qname, queue);
        }
        Ok(())
    }

    /// Knows an exclusive queue that a connection of another node declared
    /// (the cluster's record of it): every client here is refused it with
    /// 405, as RabbitMQ refuses any connection but the owner, and publishes
    /// routed to it go to that node, as the owner's RPC replies do. Nothing
    /// is recorded; an existing queue is left as it is.
    pub fn admin_know_exclusive_queue(
        &mut self,
        def: QueueDef,
        node: &str,
    ) -> Result<(), BrokerError> {
        let Some(v) = self.vhosts.get(&def.vhost) else {
            return Err(BrokerError::Invalid(format!("no vhost '{}'", def.vhost)));
        };
        if v.queues.contains_key(def.name.as_str()) {
            return Ok(());
        }
        let opts = QueueOpts {
            durable: def.durable,
            exclusive: true,
            auto_delete: def.auto_delete,
            arguments: def.arguments,
        };
        let qname: Arc<str> = Arc::from(def.name.as_str());
        let mut queue = self.make_queue(&def.vhost, qname.clone(), opts, Some(OWNER_ELSEWHERE))?;
        queue.remote = Some(Elsewhere::Node(Arc::from(node)));
        if let Some(v) = self.vhosts.get_mut(&def.vhost) {
            v.queues.insert(qname, queue);
        }
        Ok(())
    }

    /// Declares an exchange as a definitions file does. An existing one is
    /// left as it is.
    pub fn admin_declare_exchange(&mut self, def: ExchangeDef) -> Result<(), BrokerError> {
        let Some(v) = self.vhosts.get(&def.vhost) else {
            return Err(BrokerError::Invalid(format!("no vhost '{}'", def.vhost)));
        };
        if v.exchanges.contains_key(&def.name) || def.name.is_empty() {
            return Ok(());
        }
        valid_name("exchange", &def.name)?;
        let Some(kind) = Kind::parse(&def.kind) else {
            return Err(BrokerError::Invalid(format!(
                "unknown exchange type '{}'",
                def.kind
            )));
        };
        self.record(
            Scope::of_exchange(def.durable),
            Change::PutExchange(def.clone()),
        )?;
        if let Some(v) = self.vhosts.get_mut(&def.vhost) {
            v.exchanges.insert(
                def.name.clone(),
                Exchange {
                    kind,
                    durable: def.durable,
                    auto_delete: def.auto_delete,
                    internal: def.internal,
                    arguments: def.arguments,
                    bindings: Default::default(),
                },
            );
        }
        Ok(())
    }

    /// Adds a binding as a definitions file does (source and destination
    /// must exist). A binding already there is left as it is.
    pub fn admin_bind(&mut self, def: BindingDef) -> Result<(), BrokerError> {
        let Some(v) = self.vhosts.get(&def.vhost) else {
            return Err(BrokerError::Invalid(format!("no vhost '{}'", def.vhost)));
        };
        let (dest, dest_scope) = if def.destination_is_exchange {
            match v.exchanges.get(&def.destination) {
                Some(x) => (
                    Dest::Exchange(def.destination.clone()),
                    Scope::of_exchange(x.durable),
                ),
                None => return Err(missing("exchange", &def.destination, &def.vhost)),
            }
        } else {
            match v.queues.get_key_value(def.destination.as_str()) {
                Some((k, q)) => (Dest::Queue(k.clone()), Scope::of_queue(&q.opts)),
                None => return Err(missing("queue", &def.destination, &def.vhost)),
            }
        };
        let Some(x) = v.exchanges.get(&def.source) else {
            return Err(missing("exchange", &def.source, &def.vhost));
        };
        if x.bindings
            .find(&dest, &def.routing_key, &def.arguments)
            .is_some()
        {
            return Ok(());
        }
        let scope = Scope::of_exchange(x.durable).min(dest_scope);
        self.record(scope, Change::PutBinding(def.clone()))?;
        if let Some(x) = self
            .vhosts
            .get_mut(&def.vhost)
            .and_then(|v| v.exchanges.get_mut(&def.source))
        {
            x.bindings.push(Binding {
                dest,
                key: def.routing_key,
                args: def.arguments,
            });
        }
        Ok(())
    }

    /// Deletes an exchange (with the bindings to and from it). False if
    /// there was none; the default and `amq.*` exchanges are refused.
    pub fn admin_delete_exchange(&mut self, vhost: &str, name: &str) -> Result<bool, BrokerError> {
        if name.is_empty() || name.starts_with("amq.") {
            return Err(BrokerError::Invalid(format!(
                "exchange '{name}' in vhost '{vhost}' is built in and cannot be deleted"
            )));
        }
        let exists = self
            .vhosts
            .get(vhost)
            .is_some_and(|v| v.exchanges.contains_key(name));
        if !exists {
            return Ok(false);
        }
        self.current = 0;
        self.remove_exchange(vhost, name)
            .map_err(|e| BrokerError::Invalid(e.to_string()))?;
        Ok(true)
    }

    /// Removes a binding (as `queue.unbind` does, without deleting an
    /// auto-delete exchange left without bindings); false if there was none.
    pub fn admin_unbind(&mut self, def: &BindingDef) -> Result<bool, BrokerError> {
        let Some(v) = self.vhosts.get(&def.vhost) else {
            return Ok(false);
        };
        let (dest, dest_scope) = if def.destination_is_exchange {
            let durable = v.exchanges.get(&def.destination).is_none_or(|x| x.durable);
            (
                Dest::Exchange(def.destination.clone()),
                Scope::of_exchange(durable),
            )
        } else {
            match v.queues.get_key_value(def.destination.as_str()) {
                Some((k, q)) => (Dest::Queue(k.clone()), Scope::of_queue(&q.opts)),
                None => return Ok(false),
            }
        };
        let Some(x) = v.exchanges.get(&def.source) else {
            return Ok(false);
        };
        let Some(pos) = x.bindings.find(&dest, &def.routing_key, &def.arguments) else {
            return Ok(false);
        };
        let scope = Scope::of_exchange(x.durable).min(dest_scope);
        self.record(scope, Change::DeleteBinding(def.clone()))?;
        if let Some(x) = self
            .vhosts
            .get_mut(&def.vhost)
            .and_then(|v| v.exchanges.get_mut(&def.source))
        {
            x.bindings.remove(pos);
        }
        Ok(true)
    }

    /// Stored policies and operator policies.
    #[must_use]
    pub fn policies(&self) -> Vec<PolicyDef> {
        self.meta.load().policies
    }

    /// Stores a policy (validated by the caller), replacing one of the same
    /// vhost, name and kind.
    pub fn put_policy(&mut self, p: PolicyDef) -> Result<(), BrokerError> {
        if !self.vhosts.contains_key(&p.vhost) {
            return Err(BrokerError::Invalid(format!("no vhost '{}'", p.vhost)));
        }
        valid_name("policy", &p.name)?;
        self.store_change(Change::PutPolicy(p))?;
        self.apply_policies(&self.meta.load().policies);
        Ok(())
    }

    /// Deletes a policy; false if there was none.
    pub fn delete_policy(
        &mut self,
        vhost: &str,
        name: &str,
        operator: bool,
    ) -> Result<bool, BrokerError> {
        let found = self
            .meta
            .load()
            .policies
            .iter()
            .any(|p| p.vhost == vhost && p.name == name && p.operator == operator);
        if found {
            self.store_change(Change::DeletePolicy {
                vhost: vhost.to_owned(),
                name: name.to_owned(),
                operator,
            })?;
            self.apply_policies(&self.meta.load().policies);
        }
        Ok(found)
    }

    /// Adds a vhost with its built-in exchanges if it is missing (as
    /// [`Broker::add_vhost`]); true if it was created.
    pub fn ensure_vhost(&mut self, name: &str) -> Result<bool, BrokerError> {
        if self.vhosts.contains_key(name) {
            return Ok(false);
        }
        valid_name("vhost", name)?;
        self.store_change(Change::PutVhost(name.to_owned()))?;
        self.vhosts.insert(name.to_owned(), new_vhost());
        Ok(true)
    }
}

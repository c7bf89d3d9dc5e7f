//! Topology: declaring, deleting, binding and purging exchanges and queues
//! (with RabbitMQ's equivalence and exclusivity checks), auto-delete, a new
//! queue's master locator, and where each change is recorded (`Scope`).

use std::collections::VecDeque;
use std::sync::Arc;

use warren_amqp::amq_protocol::protocol::{exchange, queue};
use warren_amqp::amq_protocol::types::{AMQPValue, FieldTable};
use warren_amqp::{AmqpError, ChannelId, Reply, ReplyCode};
use warren_backing_queue::{BackingQueue, QueueConfig};
use warren_mirror::HeldPublishes;
use warren_policy::MasterLocator;

use super::args::{
    COMPARED_EXCHANGE_ARGS, COMPARED_QUEUE_ARGS, args_inequivalent, inequivalent, queue_args,
};
use super::link::{Asked, LinkMsg};
use super::persistence::{queue_dir, transient_dir};
use super::publish::confirm_one;
use super::state::{Binding, Dest, Exchange, Queue, QueueOpts, Vhost};
use super::{Broker, ConnId, Elsewhere, Store, err, policies, random_name, stats};
use crate::BrokerError;
use crate::auth::Access;
use crate::meta::{BindingDef, Change, ExchangeDef, QueueDef};
use crate::names::{check_name, shown};
use crate::routing::Kind;

/// Every vhost's `amq.*` exchanges (the cluster's metadata takes bindings
/// to these names without a record of them: `warren_cluster`'s
/// `BUILTIN_EXCHANGES`).
fn builtin_exchanges() -> Vec<(&'static str, Kind)> {
    vec![
        ("amq.direct", Kind::Direct),
        ("amq.fanout", Kind::Fanout),
        ("amq.topic", Kind::Topic),
        ("amq.headers", Kind::Headers),
        ("amq.match", Kind::Headers),
    ]
}

pub(super) fn new_vhost() -> Vhost {
    let mut v = Vhost::default();
    for (name, kind) in builtin_exchanges() {
        v.exchanges.insert(
            name.to_owned(),
            Exchange {
                kind,
                durable: true,
                auto_delete: false,
                internal: false,
                arguments: FieldTable::default(),
                bindings: Default::default(),
            },
        );
    }
    v
}

impl Broker {
    pub(super) fn make_queue(
        &mut self,
        vhost: &str,
        name: Arc<str>,
        opts: QueueOpts,
        owner: Option<ConnId>,
    ) -> Result<Queue, BrokerError> {
        let def = self.queue_policy(vhost, &name, opts.exclusive);
        let args = policies::effective_args(&opts.arguments, &name, vhost, &def)
            .map_err(|e| BrokerError::Invalid(e.to_string()))?;
        let qcfg = QueueConfig {
            limits: args.limits,
            record_ops: false,
            // A policy may name a dead-letter exchange later.
            report_dropped: true,
            max_priority: args.max_priority,
        };
        // A new queue holds no publish; one opened again from a log that
        // was there, some that nothing here lists.
        let mut kept_held = HeldPublishes::new();
        let (bq, dir, spill_dir) = if opts.durable && !opts.exclusive {
            let dir = queue_dir(&self.cfg.data_dir, vhost, &name);
            let (bq, report) =
                BackingQueue::open_in(self.cfg.storage.clone(), &dir, qcfg, args.store_config())?;
            if report.found {
                kept_held = HeldPublishes::unknown();
            }
            if let Some((file, off)) = report.truncated {
                tracing::warn!(file = %file.display(), offset = off, "cut a torn tail off a queue log");
            }
            (bq, Some(dir), None)
        } else {
            // In memory up to its budget; a log only once past it.
            let dir = transient_dir(&self.cfg.data_dir, vhost, &name);
            let bq =
                BackingQueue::spilling(self.cfg.storage.clone(), &dir, qcfg, args.store_config());
            (bq, None, Some(dir))
        };
        let uid = self.next_uid;
        self.next_uid += 1;
        let single_active = matches!(
            opts.arguments.inner().get("x-single-active-consumer"),
            Some(AMQPValue::Boolean(true))
        );
        let mut queue = Queue {
            name,
            uid,
            opts,
            owner,
            store: Store::Local(bq),
            remote: None,
            handed_over: false,
            held_for_replica: false,
            kept_held,
            consumers: Vec::new(),
            rr: 0,
            single_active,
            active: None,
            had_consumers: false,
            consumer_left_unseen: false,
            stale_master: None,
            master_down: None,
            old_master: None,
            dlx: args.dlx,
            dlrk: args.dlrk,
            expires_ms: args.expires_ms,
            reject: args.reject,
            limits: args.limits,
            max_priority: args.max_priority,
            lazy: args.lazy == Some(true),
            delivered_at_ms: 0,
            settled_at_ms: 0,
            paced: false,
            last_used_ms: self.now,
            remote_figures: None,
            parked: Default::default(),
            confirms: VecDeque::new(),
            dir,
            spill_dir,
            counters: stats::QueueCounters::default(),
        };
        let hook = self.unsynced.hook(vhost, &queue.name, uid);
        queue.store.on_unsynced(hook);
        Ok(queue)
    }

    pub(super) fn auto_delete_if_unused(&mut self, vhost: &str, qname: &str) -> bool {
        let del = self
            .vhosts
            .get(vhost)
            .and_then(|v| v.queues.get(qname))
            .is_some_and(|q| {
                // The serving node decides: it sees every node's consumers.
                q.remote.is_none()
                    && q.opts.auto_delete
                    && q.had_consumers
                    && q.consumers.is_empty()
            });
        if del {
            self.delete_queue(vhost, qname);
        }
        del
    }

    pub(super) fn exchange_declare(
        &mut self,
        id: ConnId,
        ch: ChannelId,
        d: &exchange::Declare,
    ) -> Result<(), AmqpError> {
        let vhost = self.conns[&id].vhost.clone();
        let name = d.exchange.as_str();
        if name.is_empty() {
            return Err(err(
                ReplyCode::AccessRefused,
                "operation not permitted on the default exchange",
            ));
        }
        let v = self
            .vhosts
            .get(&vhost)
            .ok_or_else(|| AmqpError::vhost_not_found(&vhost))?;
        if d.passive {
            if !v.exchanges.contains_key(name) {
                return Err(AmqpError::exchange_not_found(name, &vhost));
            }
        } else {
            if !v.exchanges.contains_key(name)
                && let Err(e) = check_name(name)
            {
                return Err(err(
                    ReplyCode::PreconditionFailed,
                    format!(
                        "exchange name '{}' in vhost '{}' is invalid: {e}",
                        shown(name),
                        shown(&vhost)
                    ),
                ));
            }
            // RabbitMQ 3.10 closes the connection (503, recorded: the
            // conformance scenario exchange_type_unknown), and its federation
            // plugin counts on it: a federated exchange's link declares an
            // `x-federation-upstream` exchange on the upstream on a
            // connection of its own, and declares a fanout instead when that
            // connection is closed with 503.
            let kind = Kind::parse(d.kind.as_str()).ok_or_else(|| {
                err(
                    ReplyCode::CommandInvalid,
                    format!("unknown exchange type '{}'", shown(d.kind.as_str())),
                )
            })?;
            if let Some(x) = v.exchanges.get(name) {
                let neq = |arg: &str, got: String, cur: String| {
                    Err(inequivalent("exchange", arg, name, &vhost, &got, &cur))
                };
                if x.kind != kind {
                    return neq("type", kind.as_str().into(), x.kind.as_str().into());
                }
                if x.durable != d.durable {
                    return neq("durable", d.durable.to_string(), x.durable.to_string());
                }
                if x.auto_delete != d.auto_delete {
                    return neq(
                        "auto_delete",
                        d.auto_delete.to_string(),
                        x.auto_delete.to_string(),
                    );
                }
                if x.internal != d.internal {
                    return neq("internal", d.internal.to_string(), x.internal.to_string());
                }
                if let Some(e) = args_inequivalent(
                    "exchange",
                    &COMPARED_EXCHANGE_ARGS,
                    &x.arguments,
                    &d.arguments,
                    name,
                    &vhost,
                ) {
                    return Err(e);
                }
            } else {
                if name.starts_with("amq.") {
                    return Err(err(
                        ReplyCode::AccessRefused,
                        format!("exchange name '{name}' contains reserved prefix 'amq.*'"),
                    ));
                }
                self.check(id, Access::Configure, "exchange", name)?;
                self.record(
                    Scope::of_exchange(d.durable),
                    Change::PutExchange(ExchangeDef {
                        vhost: vhost.clone(),
                        name: name.to_owned(),
                        kind: kind.as_str().to_owned(),
                        durable: d.durable,
                        auto_delete: d.auto_delete,
                        internal: d.internal,
                        arguments: d.arguments.clone(),
                    }),
                )
                .map_err(meta_err)?;
                let v = self.vhosts.get_mut(&vhost).expect("vhost present");
                v.exchanges.insert(
                    name.to_owned(),
                    Exchange {
                        kind,
                        durable: d.durable,
                        auto_delete: d.auto_delete,
                        internal: d.internal,
                        arguments: d.arguments.clone(),
                        bindings: Default::default(),
                    },
                );
            }
        }
        if !d.nowait {
            self.conn(id).amqp.reply(ch, Reply::ExchangeDeclareOk);
        }
        Ok(())
    }

    pub(super) fn exchange_delete(
        &mut self,
        id: ConnId,
        ch: ChannelId,
        d: &exchange::Delete,
    ) -> Result<(), AmqpError> {
        let vhost = self.conns[&id].vhost.clone();
        let name = d.exchange.as_str();
        if name.is_empty() {
            return Err(err(
                ReplyCode::AccessRefused,
                "operation not permitted on the default exchange",
            ));
        }
        if name.starts_with("amq.") {
            return Err(err(
                ReplyCode::AccessRefused,
                format!("deletion of system exchange '{name}' in vhost '{vhost}' not allowed"),
            ));
        }
        let v = self
            .vhosts
            .get(&vhost)
            .ok_or_else(|| AmqpError::vhost_not_found(&vhost))?;
        if let Some(x) = v.exchanges.get(name) {
            self.check(id, Access::Configure, "exchange", name)?;
            if d.if_unused && !x.bindings.is_empty() {
                return Err(err(
                    ReplyCode::PreconditionFailed,
                    format!("exchange '{name}' in vhost '{vhost}' in use"),
                ));
            }
            self.remove_exchange(&vhost, name)?;
        }
        if !d.nowait {
            self.conn(id).amqp.reply(ch, Reply::ExchangeDeleteOk);
        }
        Ok(())
    }

    pub(super) fn remove_exchange(&mut self, vhost: &str, name: &str) -> Result<(), AmqpError> {
        let Some(v) = self.vhosts.get_mut(vhost) else {
            return Ok(());
        };
        let Some(x) = v.exchanges.remove(name) else {
            return Ok(());
        };
        let dest = Dest::Exchange(name.to_owned());
        let mut emptied = Vec::new();
        for (xn, other) in &mut v.exchanges {
            let removed = other.bindings.remove_to(&dest);
            if other.auto_delete && removed > 0 && other.bindings.is_empty() {
                emptied.push(xn.clone());
            }
        }
        self.record(
            Scope::of_exchange(x.durable),
            Change::DeleteExchange {
                vhost: vhost.to_owned(),
                name: name.to_owned(),
            },
        )
        .map_err(meta_err)?;
        for e in emptied {
            self.remove_exchange(vhost, &e)?;
        }
        Ok(())
    }

    pub(super) fn bind(
        &mut self,
        id: ConnId,
        source: &str,
        dest: Dest,
        key: &str,
        args: &FieldTable,
        add: bool,
    ) -> Result<(), AmqpError> {
        let vhost = self.conns[&id].vhost.clone();
        if source.is_empty() {
            return Err(err(
                ReplyCode::AccessRefused,
                "operation not permitted on the default exchange",
            ));
        }
        let v = self
            .vhosts
            .get(&vhost)
            .ok_or_else(|| AmqpError::vhost_not_found(&vhost))?;
        if !add {
            // Unbinding is idempotent in RabbitMQ (3.10 too): a missing
            // source or destination is no error, once permissions allow it.
            let (dest_name, dest_kind, dest_there) = match &dest {
                Dest::Queue(q) => (&**q, "queue", v.queues.contains_key(q)),
                Dest::Exchange(e) => (e.as_str(), "exchange", v.exchanges.contains_key(e)),
            };
            if !dest_there || !v.exchanges.contains_key(source) {
                self.check(id, Access::Write, dest_kind, dest_name)?;
                self.check(id, Access::Read, "exchange", source)?;
                return Ok(());
            }
        }
        let (dest_name, dest_kind, dest_scope) = match &dest {
            Dest::Queue(q) => {
                let queue = v
                    .queues
                    .get(q)
                    .ok_or_else(|| AmqpError::queue_not_found(q, &vhost))?;
                (q.to_string(), "queue", Scope::of_queue(&queue.opts))
            }
            Dest::Exchange(e) => {
                if e.is_empty() {
                    return Err(err(
                        ReplyCode::AccessRefused,
                        "operation not permitted on the default exchange",
                    ));
                }
                let x = v
                    .exchanges
                    .get(e)
                    .ok_or_else(|| AmqpError::exchange_not_found(e, &vhost))?;
                (e.clone(), "exchange", Scope::of_exchange(x.durable))
            }
        };
        let src = v
            .exchanges
            .get(source)
            .ok_or_else(|| AmqpError::exchange_not_found(source, &vhost))?;
        let scope = Scope::of_exchange(src.durable).min(dest_scope);
        let headers = src.kind == Kind::Headers;
        self.check(id, Access::Write, dest_kind, &dest_name)?;
        self.check(id, Access::Read, "exchange", source)?;
        if add && headers {
            check_x_match(args)?;
        }
        let def = BindingDef {
            vhost: vhost.clone(),
            source: source.to_owned(),
            destination: dest_name,
            destination_is_exchange: matches!(dest, Dest::Exchange(_)),
            routing_key: key.to_owned(),
            arguments: args.clone(),
        };
        let v = self.vhosts.get_mut(&vhost).expect("vhost present");
        let x = v.exchanges.get_mut(source).expect("exchange present");
        let pos = x.bindings.find(&dest, key, args);
        if add {
            if pos.is_none() {
                x.bindings.push(Binding {
                    dest,
                    key: key.to_owned(),
                    args: args.clone(),
                });
                self.record(scope, Change::PutBinding(def))
                    .map_err(meta_err)?;
            }
        } else if let Some(pos) = pos {
            x.bindings.remove(pos);
            let gone = x.auto_delete && x.bindings.is_empty();
            self.record(scope, Change::DeleteBinding(def))
                .map_err(meta_err)?;
            if gone {
                self.remove_exchange(&vhost, source)?;
            }
        }
        Ok(())
    }

    pub(super) fn queue_declare(
        &mut self,
        id: ConnId,
        ch: ChannelId,
        d: &queue::Declare,
    ) -> Result<(), AmqpError> {
        // An exclusive queue is never durable: RabbitMQ ignores the durable
        // flag of an exclusive declare, both to create and to compare.
        let exclusive_durable;
        let d = if d.exclusive && d.durable {
            exclusive_durable = queue::Declare {
                durable: false,
                ..d.clone()
            };
            &exclusive_durable
        } else {
            d
        };
        let vhost = self.conns[&id].vhost.clone();
        if let Some(exists) = self.reply_to_exists(d.queue.as_str()) {
            // RabbitMQ's answer for direct reply-to's queues, passive or not.
            if !exists {
                return Err(AmqpError::queue_not_found(d.queue.as_str(), &vhost));
            }
            if !d.nowait {
                self.conn(id).amqp.reply(
                    ch,
                    Reply::QueueDeclareOk {
                        queue: d.queue.to_string(),
                        message_count: 0,
                        consumer_count: 1,
                    },
                );
            }
            return Ok(());
        }
        let mut name = d.queue.as_str().to_owned();
        if name.is_empty() {
            if d.passive {
                name = self.queue_name(id, ch, &d.queue)?;
            } else {
                name = random_name("amq.gen-");
            }
        }
        let v = self
            .vhosts
            .get(&vhost)
            .ok_or_else(|| AmqpError::vhost_not_found(&vhost))?;
        let exists = v.queues.contains_key(name.as_str());
        if d.passive || exists {
            let q = v
                .queues
                .get(name.as_str())
                .ok_or_else(|| AmqpError::queue_not_found(&name, &vhost))?;
            if let Some(owner) = q.owner
                && owner != id
            {
                return Err(locked(&name, &vhost));
            }
            if !d.passive {
                let neq = |arg: &str, got: String, cur: String| {
                    Err(inequivalent("queue", arg, &name, &vhost, &got, &cur))
                };
                // As RabbitMQ: exclusivity is checked first, and differing
                // is 405 (its owner being another, or none), not 406.
                if q.opts.exclusive != d.exclusive {
                    return Err(locked(&name, &vhost));
                }
                if q.opts.durable != d.durable {
                    return neq("durable", d.durable.to_string(), q.opts.durable.to_string());
                }
                if q.opts.auto_delete != d.auto_delete {
                    return neq(
                        "auto_delete",
                        d.auto_delete.to_string(),
                        q.opts.auto_delete.to_string(),
                    );
                }
                if let Some(e) = args_inequivalent(
                    "queue",
                    &COMPARED_QUEUE_ARGS,
                    &q.opts.arguments,
                    &d.arguments,
                    &name,
                    &vhost,
                ) {
                    return Err(e);
                }
            }
        } else {
            if let Err(e) = check_name(&name) {
                return Err(err(
                    ReplyCode::PreconditionFailed,
                    format!(
                        "queue name '{}' in vhost '{}' is invalid: {e}",
                        shown(&name),
                        shown(&vhost)
                    ),
                ));
            }
            if name.starts_with("amq.") && !d.queue.as_str().is_empty() {
                return Err(err(
                    ReplyCode::AccessRefused,
                    format!("queue name '{name}' contains reserved prefix 'amq.*'"),
                ));
            }
            self.check(id, Access::Configure, "queue", &name)?;
            let args = queue_args(&d.arguments, &name, &vhost)?;
            if let Some(dlx) = &args.dlx {
                self.check(
                    id,
                    Access::Write,
                    "exchange",
                    if dlx.is_empty() { "amq.default" } else { dlx },
                )?;
            }
            let opts = QueueOpts {
                durable: d.durable,
                exclusive: d.exclusive,
                auto_delete: d.auto_delete,
                arguments: d.arguments.clone(),
            };
            let master = if d.exclusive {
                None
            } else {
                self.locate_master(&vhost, &name, args.locator)
            };
            // Made first: a queue whose log cannot be made (a full disk)
            // is refused before anything of it is recorded.
            let scope = Scope::of_queue(&opts);
            let owner = d.exclusive.then_some(id);
            let mut q = self
                .make_queue(&vhost, Arc::from(name.as_str()), opts, owner)
                .map_err(|e| match e {
                    BrokerError::Store(e) => {
                        // The file and the error stay in the node's log.
                        tracing::error!(%vhost, queue = %name, error = %e, "could not open a new queue's log");
                        err(ReplyCode::InternalError, "could not open the queue's log")
                    }
                    e => err(ReplyCode::InternalError, e.to_string()),
                })?;
            let recorded = self.record(
                scope,
                Change::PutQueue(QueueDef {
                    vhost: vhost.clone(),
                    name: name.clone(),
                    durable: d.durable,
                    master: master.clone(),
                    auto_delete: d.auto_delete,
                    exclusive: d.exclusive,
                    arguments: d.arguments.clone(),
                }),
            );
            if let Err(e) = recorded {
                // Not recorded (a store that writes under the lock): none
                // of it stays.
                if let Some(dir) = q.dir.clone() {
                    drop(q);
                    if let Err(e) = warren_backing_queue::remove_log_dir(
                        &*self.cfg.storage,
                        self.journal.as_deref(),
                        &dir,
                    ) {
                        tracing::warn!(dir = %dir.display(), error = %e, "could not remove an unrecorded queue's files");
                    }
                }
                return Err(meta_err(e));
            }
            if let Some(m) = master {
                tracing::info!(%vhost, queue = %name, master = %m, "queue served by (its master locator's choice)");
                q.remote = Some(Elsewhere::Node(Arc::from(m.as_str())));
            }
            let v = self.vhosts.get_mut(&vhost).expect("vhost present");
            v.queues.insert(q.name.clone(), q);
        }
        let now = self.now;
        let v = self.vhosts.get_mut(&vhost).expect("vhost present");
        let q = v.queues.get_mut(name.as_str()).expect("queue present");
        q.last_used_ms = q.last_used_ms.max(now);
        let s = q.store.stats();
        let reply = Reply::QueueDeclareOk {
            queue: name.clone(),
            message_count: u32::try_from(s.ready).unwrap_or(u32::MAX),
            consumer_count: q.consumers.len() as u32,
        };
        let remote = q.remote.as_ref().and_then(Elsewhere::node).cloned();
        // No master right now, or publishes held for the next one: the
        // counts are the next master's, after those publishes.
        let held = (q.between_masters() || !q.parked.is_empty())
            && !self
                .failed_logs
                .contains_key(&(vhost.clone(), q.name.clone()));
        let c = self.conn(id);
        if let Some(chan) = c.channels.get_mut(&ch) {
            chan.last_queue = Some(name.clone());
        }
        match remote {
            _ if d.nowait => {}
            _ if held => self.hold_count((id, ch), &vhost, &name),
            // Served elsewhere: the counts are the master's.
            Some(node) => self.link_count(&node, (id, ch), &vhost, &name, Asked::Declare),
            None => {
                c.amqp.reply(ch, reply);
            }
        }
        Ok(())
    }

    pub(super) fn queue_purge(
        &mut self,
        id: ConnId,
        ch: ChannelId,
        p: &queue::Purge,
    ) -> Result<(), AmqpError> {
        let name = self.queue_name(id, ch, &p.queue)?;
        self.usable_queue(id, &name)?;
        self.check(id, Access::Read, "queue", &name)?;
        let vhost = self.conns[&id].vhost.clone();
        let q = self
            .vhosts
            .get_mut(&vhost)
            .and_then(|v| v.queues.get_mut(name.as_str()))
            .expect("queue present");
        // Served by another node: its master purges and counts.
        match q.remote.clone() {
            Some(Elsewhere::Node(node)) if !p.nowait => {
                self.link_count(&node, (id, ch), &vhost, &name, Asked::Purge);
                return Ok(());
            }
            Some(Elsewhere::Node(node)) => {
                let req = self.links.next();
                let (vhost, queue) = (vhost.clone(), name.to_string());
                self.links.send(&node, LinkMsg::Purge { vhost, queue, req });
                return Ok(());
            }
            Some(Elsewhere::Nowhere) => {
                return Err(err(
                    ReplyCode::NotFound,
                    format!(
                        "home node of durable queue '{name}' in vhost '{vhost}' is down or inaccessible"
                    ),
                ));
            }
            None => {}
        }
        let n = q
            .store
            .purge()
            .map_err(|e| err(ReplyCode::InternalError, e))?;
        self.mirror_turn(&vhost, &name);
        if !p.nowait {
            self.conn(id).amqp.reply(
                ch,
                Reply::QueuePurgeOk {
                    message_count: u32::try_from(n).unwrap_or(u32::MAX),
                },
            );
        }
        Ok(())
    }

    pub(super) fn queue_delete(
        &mut self,
        id: ConnId,
        ch: ChannelId,
        d: &queue::Delete,
    ) -> Result<(), AmqpError> {
        let name = self.queue_name(id, ch, &d.queue)?;
        let vhost = self.conns[&id].vhost.clone();
        let Some(q) = self
            .vhosts
            .get(&vhost)
            .and_then(|v| v.queues.get(name.as_str()))
        else {
            if !d.nowait {
                let reply = Reply::QueueDeleteOk { message_count: 0 };
                self.conn(id).amqp.reply(ch, reply);
            }
            return Ok(());
        };
        if let Some(owner) = q.owner
            && owner != id
        {
            return Err(locked(&name, &vhost));
        }
        self.check(id, Access::Configure, "queue", &name)?;
        let f = q.figures();
        let cond = (d.if_unused, d.if_empty);
        // A queue served by another node: its conditions are checked
        // against its master's counts (every node's consumers), and the
        // count deleted is the master's (a mirror's copy may lag).
        if let Some(Elsewhere::Node(node)) = q.remote.clone()
            && !d.nowait
        {
            let what = Asked::Delete {
                if_unused: d.if_unused,
                if_empty: d.if_empty,
            };
            self.link_count(&node, (id, ch), &vhost, &name, what);
            return Ok(());
        }
        self.delete_if(
            (id, ch),
            &vhost,
            &name,
            cond,
            (f.ready, f.consumers),
            d.nowait,
        )
    }

    /// Deletes queue `name` unless `(if_unused, if_empty)` refuse it given
    /// its `(ready, consumers)`, answering channel `ch` with delete-ok (the
    /// count of ready messages) unless `nowait`.
    pub(super) fn delete_if(
        &mut self,
        (id, ch): (ConnId, ChannelId),
        vhost: &str,
        name: &str,
        (if_unused, if_empty): (bool, bool),
        (ready, consumers): (u64, u64),
        nowait: bool,
    ) -> Result<(), AmqpError> {
        if if_unused && consumers > 0 {
            return Err(err(
                ReplyCode::PreconditionFailed,
                format!("queue '{name}' in vhost '{vhost}' in use"),
            ));
        }
        if if_empty && ready > 0 {
            return Err(err(
                ReplyCode::PreconditionFailed,
                format!("queue '{name}' in vhost '{vhost}' not empty"),
            ));
        }
        // delete-ok first, then the basic.cancel of the queue's consumers
        // (this channel's too), in RabbitMQ's order.
        if !nowait {
            let message_count = u32::try_from(ready).unwrap_or(u32::MAX);
            self.conn(id)
                .amqp
                .reply(ch, Reply::QueueDeleteOk { message_count });
        }
        self.delete_queue(vhost, name);
        Ok(())
    }

    /// Deletes a queue: cancels its consumers (server-sent basic.cancel),
    /// releases its pending confirms, removes its bindings and files.
    pub(super) fn delete_queue(&mut self, vhost: &str, name: &str) -> u32 {
        let Some(v) = self.vhosts.get_mut(vhost) else {
            return 0;
        };
        let Some(mut q) = v.queues.remove(name) else {
            return 0;
        };
        let count = u32::try_from(q.store.stats().ready).unwrap_or(u32::MAX);
        let cur = self.current;
        let forwarded: Vec<(Elsewhere, u64)> = match &q.remote {
            Some(node) => q
                .consumers
                .iter()
                .map(|c| (node.clone(), c.remote_cid))
                .collect(),
            None => Vec::new(),
        };
        for c in &q.consumers {
            if let Some(conn) = self.conns.get_mut(&c.conn) {
                if let Some(chan) = conn.channels.get_mut(&c.channel) {
                    chan.consumers.remove(&c.tag);
                }
                conn.cancel_consumer(c.channel, &c.tag);
                conn.wake(cur, c.conn);
            }
        }
        // Held publishes are confirmed as the messages of a deleted queue.
        let mut owed: Vec<(ConnId, ChannelId, u64)> = q
            .confirms
            .iter()
            .map(|&(_, conn, ch, cseq)| (conn, ch, cseq))
            .chain(q.parked.confirms())
            .collect();
        let mut answered = Vec::new();
        if let Store::Replica(m) = &mut q.store {
            owed.extend(m.owed_confirms());
            answered = m.answer_gets_empty(&mut self.conns);
            m.wake_shell();
        }
        for (conn, ch, cseq) in owed {
            confirm_one(&mut self.conns, conn, ch, cseq);
            if let Some(c) = self.conns.get_mut(&conn) {
                c.wake(cur, conn);
            }
        }
        let dest = Dest::Queue(q.name.clone());
        let mut emptied = Vec::new();
        for (xn, x) in &mut v.exchanges {
            let removed = x.bindings.remove_to(&dest);
            if x.auto_delete && removed > 0 && x.bindings.is_empty() {
                emptied.push(xn.clone());
            }
        }
        if let Err(e) = self.record(
            Scope::of_queue(&q.opts),
            Change::DeleteQueue {
                vhost: vhost.to_owned(),
                name: name.to_owned(),
            },
        ) {
            tracing::error!(error = %e, "could not record a queue deletion");
        }
        if let Some(dir) = q.dir.as_ref().or(q.spill_dir.as_ref()) {
            drop(q.store);
            if let Err(e) = warren_backing_queue::remove_log_dir(
                &*self.cfg.storage,
                self.journal.as_deref(),
                dir,
            ) {
                tracing::warn!(dir = %dir.display(), error = %e, "could not remove a deleted queue's files");
            }
        }
        for (node, cid) in forwarded {
            self.link_cancel(&node, vhost, cid);
        }
        for conn in answered {
            self.reply_answered(conn);
        }
        for e in emptied {
            if let Err(e) = self.remove_exchange(vhost, &e) {
                tracing::error!(error = %e, "auto-delete of an exchange failed");
            }
        }
        count
    }
}

pub(super) fn locked(name: &str, vhost: &str) -> AmqpError {
    err(
        ReplyCode::ResourceLocked,
        format!(
            "cannot obtain exclusive access to locked queue '{name}' in vhost '{vhost}'. It could be originally declared on another connection or the exclusive property value does not match that of the original declaration."
        ),
    )
}

/// Where a change to an entity is kept: exclusive queues (and bindings to
/// them) only here, transient entities shared through the cluster, durable
/// ones in the store. A binding is kept where its narrower end is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Scope {
    /// This node only.
    Local,
    /// Every node, until the cluster restarts (`MetadataStore::share`).
    Shared,
    /// Every node, across restarts (`MetadataStore::apply`).
    Durable,
}

impl Scope {
    /// An exclusive queue is shared in a cluster, durable or not: every
    /// node routes to it and refuses it to its own clients, and it goes
    /// with its connection.
    pub(super) fn of_queue(opts: &QueueOpts) -> Self {
        match (opts.exclusive, opts.durable) {
            (true, _) | (false, false) => Self::Shared,
            (false, true) => Self::Durable,
        }
    }

    pub(super) fn of_exchange(durable: bool) -> Self {
        if durable { Self::Durable } else { Self::Shared }
    }
}

impl Broker {
    /// Where a new queue's master goes, if a `queue-master-locator` (the
    /// argument, else the policy's; `client-local` without either) picks
    /// another node of the cluster than this one.
    fn locate_master(&self, vhost: &str, name: &str, arg: Option<MasterLocator>) -> Option<String> {
        let policy = self.queue_policy(vhost, name, false);
        let locator = arg
            .or(policy.queue_master_locator)
            .unwrap_or(MasterLocator::ClientLocal);
        if locator == MasterLocator::ClientLocal {
            return None;
        }
        let candidates = self.meta.master_candidates()?;
        let running: Vec<String> = candidates.iter().map(|(n, _)| n.clone()).collect();
        let chosen = warren_policy::locate_master(
            locator,
            &warren_policy::LocateInput {
                client_node: &self.cfg.node_name,
                exclusive: false,
                mode: policy.ha.as_ref().map(|h| &h.mode),
                running_nodes: &running,
                masters_per_node: &candidates,
                seed: rand::random(),
            },
        );
        (chosen != self.cfg.node_name).then_some(chosen)
    }

    /// Shares again queue `name` of `vhost` if it is exclusive to one of
    /// this node's connections: its record and its bindings, committed as
    /// changes nobody waits for (a queue record is taken only if the
    /// cluster has no queue of that name). For a queue whose record the
    /// cluster deleted while its connection stayed: the other nodes took
    /// this node for down while it was only cut off, and without it their
    /// clients' publishes (an RPC reply, a fanout) would no longer reach
    /// the queue once the cut heals.
    pub fn share_again(&mut self, vhost: &str, name: &str) {
        if !self.meta.shares() {
            return;
        }
        let Some(v) = self.vhosts.get(vhost) else {
            return;
        };
        let Some(q) = v.queues.get(name).filter(|q| q.owned_here()) else {
            return;
        };
        let mut changes = vec![Change::PutQueue(QueueDef {
            vhost: vhost.to_owned(),
            name: name.to_owned(),
            durable: q.opts.durable,
            master: None,
            auto_delete: q.opts.auto_delete,
            exclusive: true,
            arguments: q.opts.arguments.clone(),
        })];
        let dest = Dest::Queue(q.name.clone());
        for (source, x) in &v.exchanges {
            for b in x.bindings.to(&dest) {
                changes.push(Change::PutBinding(BindingDef {
                    vhost: vhost.to_owned(),
                    source: source.clone(),
                    destination: name.to_owned(),
                    destination_is_exchange: false,
                    routing_key: b.key.clone(),
                    arguments: b.args.clone(),
                }));
            }
        }
        tracing::info!(node = %self.cfg.node_name, %vhost, queue = %name, "sharing again an exclusive queue the cluster forgot");
        self.commit_nobody_waits(changes);
    }

    /// Records `change` where `scope` says.
    pub(super) fn record(
        &mut self,
        scope: Scope,
        change: Change,
    ) -> Result<(), crate::meta::MetaError> {
        if scope == Scope::Local || (scope == Scope::Shared && !self.meta.shares()) {
            return Ok(());
        }
        // A client's command: committed off the lock (`commits.rs`).
        let Some(change) = self.defer(change) else {
            return Ok(());
        };
        match scope {
            Scope::Local => Ok(()),
            Scope::Shared => self.meta.share(change),
            Scope::Durable => self.meta.apply(change),
        }
    }
}

pub(super) fn meta_err(e: crate::meta::MetaError) -> AmqpError {
    tracing::error!(error = %e, "metadata store failed");
    match e {
        // Why the cluster refused (no majority, a timeout) is the client's
        // to know: it tells it to try another node.
        crate::meta::MetaError::Cluster(_) => err(ReplyCode::InternalError, e.to_string()),
        // A local file's path and error stay in the node's log.
        _ => err(ReplyCode::InternalError, "metadata store failed"),
    }
}

/// A headers binding's `x-match`, as RabbitMQ's headers exchange checks it.
fn check_x_match(args: &FieldTable) -> Result<(), AmqpError> {
    let bad = |text: String| err(ReplyCode::PreconditionFailed, text);
    match args.inner().get("x-match") {
        None => Ok(()),
        Some(AMQPValue::LongString(s)) => match s.as_bytes() {
            b"all" | b"any" | b"all-with-x" | b"any-with-x" => Ok(()),
            other => Err(bad(format!(
                "Invalid x-match field value <<{:?}>>; expected all, any, all-with-x, or any-with-x",
                String::from_utf8_lossy(other)
            ))),
        },
        Some(v) => Err(bad(format!(
            "Invalid x-match field type {} (value {}); expected longstr",
            crate::routing::type_name(v),
            erlang_value(v)
        ))),
    }
}

/// A field value as Erlang's `~p` prints the simple ones.
fn erlang_value(v: &AMQPValue) -> String {
    match v {
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::Float(f) => f.to_string(),
        AMQPValue::Double(f) => f.to_string(),
        v => crate::routing::as_i64(v).map_or_else(|| "...".to_owned(), |i| i.to_string()),
    }
}

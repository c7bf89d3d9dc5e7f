//! Policies applied to queues: a queue's settings are its arguments merged
//! with its effective policy (regular and operator) as RabbitMQ's classic
//! queue does — the lower of the two for `message-ttl`, `expires`,
//! `max-length` and `max-length-bytes`; the argument when given, else the
//! policy, for `overflow`, `dead-letter-exchange` and
//! `dead-letter-routing-key`.

use std::sync::Arc;

use warren_amqp::AmqpError;
use warren_amqp::amq_protocol::types::FieldTable;
use warren_policy::{Definition, Overflow, Policy, PolicyKind, PolicySet, PolicySpec};

use super::{Broker, QueueArgs, RejectPublish, queue_args};
use crate::meta::PolicyDef;

/// The policy set of stored policy definitions (an invalid one is skipped
/// with a warning: it was validated when it was set).
pub fn policy_set(defs: &[PolicyDef]) -> PolicySet {
    let mut set = PolicySet::new();
    for d in defs {
        let apply_to = serde_json::from_value(serde_json::Value::String(d.apply_to.clone()))
            .unwrap_or_default();
        let spec = PolicySpec::new(&d.vhost, &d.name, &d.pattern, d.definition.clone())
            .apply_to(apply_to)
            .priority(d.priority);
        let kind = if d.operator {
            PolicyKind::Operator
        } else {
            PolicyKind::Regular
        };
        match Policy::new(kind, &spec) {
            Ok(p) => {
                set.set(p);
            }
            Err(e) => {
                tracing::warn!(vhost = %d.vhost, policy = %d.name, error = %e, "skipping a stored policy");
            }
        }
    }
    set
}

fn min_opt(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, y) => x.or(y),
    }
}

/// Queue `queue`'s settings from its arguments and its effective policy
/// definition `def`.
pub(super) fn effective_args(
    args: &FieldTable,
    queue: &str,
    vhost: &str,
    def: &Definition,
) -> Result<QueueArgs, AmqpError> {
    let mut a = queue_args(args, queue, vhost)?;
    if a.lazy.is_none() {
        a.lazy = def.queue_mode.map(|m| m == warren_policy::QueueMode::Lazy);
    }
    a.limits.max_length = min_opt(a.limits.max_length, def.max_length);
    a.limits.max_length_bytes = min_opt(a.limits.max_length_bytes, def.max_length_bytes);
    a.limits.message_ttl_ms = min_opt(a.limits.message_ttl_ms, def.message_ttl);
    a.expires_ms = min_opt(a.expires_ms, def.expires);
    if a.dlx.is_none() {
        a.dlx.clone_from(&def.dead_letter_exchange);
    }
    if a.dlrk.is_none() {
        a.dlrk.clone_from(&def.dead_letter_routing_key);
    }
    // With reject-publish the queue refuses publishes instead of the store
    // dropping its head: the store gets no length limits.
    a.reject = match a.overflow.or(def.overflow) {
        None | Some(Overflow::DropHead) => None,
        Some(o) => Some(RejectPublish {
            max_length: a.limits.max_length.take(),
            max_length_bytes: a.limits.max_length_bytes.take(),
            dead_letter: o == Overflow::RejectPublishDlx,
        }),
    };
    Ok(a)
}

impl Broker {
    /// The effective policy definition of queue `name`.
    pub(super) fn queue_policy(&self, vhost: &str, name: &str, exclusive: bool) -> Definition {
        self.policies
            .effective_for_queue(vhost, name, exclusive)
            .definition
    }

    /// Applies the stored policies `defs` to every queue (call after any
    /// policy change; the cluster's metadata replay does).
    pub fn apply_policies(&mut self, defs: &[PolicyDef]) {
        self.policies = policy_set(defs);
        let queues: Vec<(String, Arc<str>)> = self
            .vhosts
            .iter()
            .flat_map(|(v, vh)| vh.queues.keys().map(move |q| (v.clone(), q.clone())))
            .collect();
        for (vhost, name) in queues {
            self.apply_queue_policy(&vhost, &name);
        }
    }

    /// Brings queue `name`'s settings in line with its arguments and policy.
    fn apply_queue_policy(&mut self, vhost: &str, name: &str) {
        let Some(q) = self.vhosts.get(vhost).and_then(|v| v.queues.get(name)) else {
            return;
        };
        let def = self.queue_policy(vhost, name, q.opts.exclusive);
        let Ok(s) = effective_args(&q.opts.arguments, name, vhost, &def) else {
            return;
        };
        let Some(q) = self.queue_mut(vhost, name) else {
            return;
        };
        let lazy = s.lazy == Some(true);
        if q.lazy != lazy {
            q.lazy = lazy;
            q.store
                .set_resident_bytes_max(s.store_config().resident_bytes_max);
        }
        let same = q.dlx == s.dlx
            && q.dlrk == s.dlrk
            && q.expires_ms == s.expires_ms
            && q.reject == s.reject
            && q.limits == s.limits;
        if same {
            return;
        }
        q.dlx = s.dlx;
        q.dlrk = s.dlrk;
        q.expires_ms = s.expires_ms;
        q.reject = s.reject;
        if q.limits != s.limits {
            q.limits = s.limits;
            if let Err(e) = q.store.set_limits(s.limits) {
                tracing::warn!(%vhost, queue = %name, error = %e, "applying a policy's limits failed");
            }
        }
        // New limits may have dropped messages (dead-lettered now).
        self.after_queue_op(vhost, name);
    }
}

//! Queue arguments (`x-message-ttl`, `x-max-length`, `x-dead-letter-exchange`,
//! `x-overflow`, `x-max-priority`, …): checked and turned into settings, and
//! the equivalence check of a redeclare (406 PRECONDITION_FAILED).

use warren_amqp::amq_protocol::types::{AMQPValue, FieldTable};
use warren_amqp::{AmqpError, ReplyCode};
use warren_backing_queue::{Limits, StoreConfig};
use warren_policy::MasterLocator;

use super::err;
use crate::names::{BadName, MAX_NAME_BYTES, check_name};
use crate::routing::{self, as_i64, as_str, type_name};

/// Queue arguments checked and turned into settings.
pub(super) struct QueueArgs {
    /// What the store enforces (with `reject`, no length limits: the
    /// queue refuses publishes instead of dropping its head).
    pub(super) limits: Limits,
    pub(super) expires_ms: Option<u64>,
    pub(super) dlx: Option<String>,
    pub(super) dlrk: Option<String>,
    /// `x-overflow` as given (`None`: not given, drop-head).
    pub(super) overflow: Option<warren_policy::Overflow>,
    /// Set from `overflow` by [`policies::effective_args`](super::policies::effective_args).
    pub(super) reject: Option<RejectPublish>,
    /// `x-max-priority`.
    pub(super) max_priority: Option<u8>,
    /// `x-queue-master-locator`.
    pub(super) locator: Option<MasterLocator>,
    /// `x-queue-mode` (`Some(true)`: lazy, bodies only on disk), or else a
    /// policy's `queue-mode`: the argument wins, as RabbitMQ resolves it
    /// (`res_arg`).
    pub(super) lazy: Option<bool>,
}

/// Body bytes a durable queue keeps in memory in the default mode; the
/// bodies of messages beyond live only in its log and are read back when
/// delivered, so a backlog larger than memory fits (RabbitMQ pages a
/// default-mode queue out under memory pressure; a lazy queue keeps
/// nothing). Transient queues have no log and keep everything.
pub const QUEUE_RESIDENT_MAX: u64 = 64 << 20;

/// The store settings of a queue, lazy or not.
pub(super) fn store_config(lazy: bool) -> StoreConfig {
    StoreConfig {
        resident_bytes_max: if lazy { 0 } else { QUEUE_RESIDENT_MAX },
        ..StoreConfig::default()
    }
}

impl QueueArgs {
    /// The queue's store settings.
    pub(super) fn store_config(&self) -> StoreConfig {
        store_config(self.lazy == Some(true))
    }
}

/// `x-overflow: reject-publish` (or `reject-publish-dlx`): a full queue
/// refuses new publishes (nacked) instead of dropping its oldest messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RejectPublish {
    pub(super) max_length: Option<u64>,
    pub(super) max_length_bytes: Option<u64>,
    /// `reject-publish-dlx`: refused messages are dead-lettered too.
    pub(super) dead_letter: bool,
}

impl RejectPublish {
    /// Whether a queue with `stats` refuses another publish.
    pub(super) fn full(&self, stats: &warren_backing_queue::Stats) -> bool {
        self.max_length.is_some_and(|m| stats.ready >= m)
            || self
                .max_length_bytes
                .is_some_and(|m| stats.ready_bytes >= m)
    }
}

/// The longest TTL or per-message expiration, in ms: ten years, RabbitMQ
/// 3.10's bound (`rabbit_misc:check_expiry`).
pub(super) const MAX_EXPIRY_MS: u64 = 315_360_000_000;

/// A message's `expiration` property, read as RabbitMQ reads it (an
/// optional sign and digits, nothing after them, 0 up to
/// [`MAX_EXPIRY_MS`]); the error is RabbitMQ's reason, as its channel
/// close prints it.
pub(super) fn parse_expiration(text: &str) -> Result<u64, String> {
    let digits_from = usize::from(text.starts_with(['+', '-']));
    let digits = text[digits_from..]
        .bytes()
        .take_while(u8::is_ascii_digit)
        .count();
    if digits == 0 {
        return Err("no_integer".into());
    }
    let end = digits_from + digits;
    let rest = &text[end..];
    if !rest.is_empty() {
        return Err(format!("{{leftover_string,{rest:?}}}"));
    }
    let magnitude = text[digits_from..end].trim_start_matches('0');
    let magnitude = if magnitude.is_empty() { "0" } else { magnitude };
    let negative = text.starts_with('-') && magnitude != "0";
    if negative {
        return Err(format!("{{value_negative,-{magnitude}}}"));
    }
    match magnitude.parse::<u64>() {
        Ok(n) if n <= MAX_EXPIRY_MS => Ok(n),
        _ => Err(format!("{{value_too_large,{magnitude}}}")),
    }
}

pub(super) fn queue_args(
    args: &FieldTable,
    queue: &str,
    vhost: &str,
) -> Result<QueueArgs, AmqpError> {
    let bad = |k: &str, why: &str| {
        err(
            ReplyCode::PreconditionFailed,
            format!("invalid arg '{k}' for queue '{queue}' in vhost '{vhost}': {why}"),
        )
    };
    let mut out = QueueArgs {
        limits: Limits::default(),
        expires_ms: None,
        dlx: None,
        dlrk: None,
        overflow: None,
        reject: None,
        max_priority: None,
        locator: None,
        lazy: None,
    };
    for (k, v) in args.inner() {
        let key = k.as_str();
        // RabbitMQ 3.10's checks and texts (recorded: the conformance
        // scenario declare_argument_types): an integer type (not a
        // timestamp), then its range.
        let int = || {
            match v {
                AMQPValue::Timestamp(_) => None,
                v => as_i64(v),
            }
            .ok_or_else(|| bad(key, &format!("\"expected integer, got {}\"", type_name(v))))
        };
        let non_neg = || {
            let n = int()?;
            u64::try_from(n).map_err(|_| bad(key, &format!("{{value_negative,{n}}}")))
        };
        let unacceptable = || bad(key, &format!("{{unacceptable_type,{}}}", type_name(v)));
        match key {
            "x-message-ttl" => {
                let ttl = non_neg()?;
                if ttl > MAX_EXPIRY_MS {
                    return Err(bad(key, &format!("{{value_too_large,{ttl}}}")));
                }
                out.limits.message_ttl_ms = Some(ttl);
            }
            "x-max-length" => out.limits.max_length = Some(non_neg()?),
            "x-max-length-bytes" => out.limits.max_length_bytes = Some(non_neg()?),
            "x-expires" => {
                let n = non_neg()?;
                if n == 0 {
                    return Err(bad(key, "{value_zero,0}"));
                }
                out.expires_ms = Some(n);
            }
            "x-dead-letter-exchange" => {
                let dlx = as_str(v).ok_or_else(|| {
                    err(
                        ReplyCode::PreconditionFailed,
                        format!(
                            "invalid type '{}' for arg '{key}' in queue '{queue}' in vhost '{vhost}'",
                            type_name(v)
                        ),
                    )
                })?;
                check_name(&dlx).map_err(|e| bad(key, &e.to_string()))?;
                out.dlx = Some(dlx);
            }
            "x-dead-letter-routing-key" => {
                let dlrk = as_str(v).ok_or_else(unacceptable)?;
                if dlrk.len() > MAX_NAME_BYTES {
                    return Err(bad(key, &BadName::TooLong(dlrk.len()).to_string()));
                }
                out.dlrk = Some(dlrk);
            }
            "x-overflow" => {
                use warren_policy::Overflow;
                out.overflow = Some(match as_str(v).ok_or_else(unacceptable)?.as_str() {
                    "drop-head" => Overflow::DropHead,
                    "reject-publish" => Overflow::RejectPublish,
                    "reject-publish-dlx" => Overflow::RejectPublishDlx,
                    _ => return Err(bad(key, "invalid_overflow")),
                });
            }
            "x-max-priority" => {
                // RabbitMQ 3.10's checks and texts: an integer type (not a
                // timestamp), 0 ..= 255.
                let n = int()?;
                let max = u8::try_from(n).map_err(|_| {
                    bad(
                        key,
                        &if n < 0 {
                            format!("{{value_negative,{n}}}")
                        } else {
                            format!("{{max_value_exceeded,{n}}}")
                        },
                    )
                })?;
                out.max_priority = Some(max);
            }
            "x-queue-master-locator" => {
                // RabbitMQ 3.10 crashes the channel on any other value and
                // closes the connection with a bare 541.
                let name = as_str(v).unwrap_or_default();
                out.locator = Some(
                    MasterLocator::from_name(&name)
                        .ok_or_else(|| err(ReplyCode::InternalError, ""))?,
                );
            }
            "x-queue-mode" => {
                // RabbitMQ 3.10's refusals (recorded: the conformance
                // scenario queue_mode).
                out.lazy = match v {
                    AMQPValue::LongString(s) => match s.as_bytes() {
                        b"lazy" => Some(true),
                        b"default" => Some(false),
                        other => {
                            let why = format!(
                                "\"unsupported queue mode '{}'\"",
                                String::from_utf8_lossy(other)
                            );
                            return Err(bad(key, &why));
                        }
                    },
                    v => {
                        let why = format!("{{unacceptable_type,{}}}", type_name(v));
                        return Err(bad(key, &why));
                    }
                };
            }
            "x-single-active-consumer" if !matches!(v, AMQPValue::Boolean(_)) => {
                return Err(unacceptable());
            }
            "x-queue-type" if as_str(v).as_deref() != Some("classic") => {
                return Err(bad(key, "only classic queues are supported"));
            }
            _ => {}
        }
    }
    if out.dlrk.is_some() && out.dlx.is_none() {
        return Err(bad(
            "x-dead-letter-routing-key",
            "routing_key_but_no_dlx_defined",
        ));
    }
    Ok(out)
}

/// RabbitMQ's 406 for redeclaring with other settings.
pub(super) fn inequivalent(
    what: &str,
    arg: &str,
    name: &str,
    vhost: &str,
    got: &str,
    cur: &str,
) -> AmqpError {
    err(
        ReplyCode::PreconditionFailed,
        format!(
            "inequivalent arg '{arg}' for {what} '{name}' in vhost '{vhost}': received '{got}' but current is '{cur}'"
        ),
    )
}

/// The queue arguments a redeclare must repeat (RabbitMQ 3.10's classic
/// queue `queue_arguments`); others may differ freely.
pub(super) const COMPARED_QUEUE_ARGS: [&str; 15] = [
    "x-expires",
    "x-message-ttl",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-max-length",
    "x-max-length-bytes",
    "x-max-in-memory-length",
    "x-max-in-memory-bytes",
    "x-max-priority",
    "x-overflow",
    "x-queue-mode",
    "x-queue-version",
    "x-single-active-consumer",
    "x-queue-type",
    "x-queue-master-locator",
];

/// The exchange arguments a redeclare must repeat (RabbitMQ's).
pub(super) const COMPARED_EXCHANGE_ARGS: [&str; 1] = ["alternate-exchange"];

/// RabbitMQ's 406 if a redeclare of `what` (`queue`, `exchange`) `name`
/// changes, adds or drops one of the `compared` arguments.
pub(super) fn args_inequivalent(
    what: &str,
    compared: &[&str],
    current: &FieldTable,
    received: &FieldTable,
    name: &str,
    vhost: &str,
) -> Option<AmqpError> {
    let (cur, got) = (current.inner(), received.inner());
    compared.iter().find_map(|&k| {
        let (c, g) = (cur.get(k), got.get(k));
        let text = match (c, g) {
            (None, None) => return None,
            (Some(c), Some(g)) if routing::values_equal(c, g) => return None,
            (Some(c), Some(g)) => format!(
                "received '{}' but current is '{}'",
                routing::show_value(Some(g)),
                routing::show_value(Some(c))
            ),
            // One side is missing: RabbitMQ names the other's type.
            _ => format!("received {} but current is {}", typed(g), typed(c)),
        };
        Some(err(
            ReplyCode::PreconditionFailed,
            format!("inequivalent arg '{k}' for {what} '{name}' in vhost '{vhost}': {text}"),
        ))
    })
}

/// An argument as RabbitMQ shows one that the other side lacks.
fn typed(v: Option<&AMQPValue>) -> String {
    match v {
        None => "none".to_owned(),
        Some(v) => format!(
            "the value '{}' of type '{}'",
            routing::show_value(Some(v)),
            type_name(v)
        ),
    }
}

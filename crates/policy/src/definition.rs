//! Policy definitions: the JSON object of keys, parsed into typed settings.
//!
//! [`Definition::parse`] checks every key (unknown keys are refused) and
//! returns the first problem as a [`DefinitionError`] whose message names the
//! key and the rule. [`Definition::merge_operator`] combines a regular policy
//! with an operator policy the way RabbitMQ does.

use std::fmt;
use std::num::{NonZeroU32, NonZeroU64};

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde_json::{Map, Value};

use crate::error::DefinitionError;
use crate::policy::PolicyKind;

/// The definition keys Warren knows, spelt as RabbitMQ spells them.
pub mod keys {
    /// Mirroring mode: `all`, `exactly` or `nodes`.
    pub const HA_MODE: &str = "ha-mode";
    /// The mode's parameter: a count for `exactly`, node names for `nodes`.
    pub const HA_PARAMS: &str = "ha-params";
    /// How new mirrors catch up: `manual` (default) or `automatic`.
    pub const HA_SYNC_MODE: &str = "ha-sync-mode";
    /// Messages per synchronisation batch (a positive integer).
    pub const HA_SYNC_BATCH_SIZE: &str = "ha-sync-batch-size";
    /// Promotion when the master stops cleanly: `when-synced` (default) or `always`.
    pub const HA_PROMOTE_ON_SHUTDOWN: &str = "ha-promote-on-shutdown";
    /// Promotion when the master fails: `always` (default) or `when-synced`.
    pub const HA_PROMOTE_ON_FAILURE: &str = "ha-promote-on-failure";
    /// Warren only: confirms are held while fewer replicas than this are synchronised.
    pub const HA_MIN_SYNC_REPLICAS: &str = "ha-min-sync-replicas";
    /// Where a new queue's master goes: `client-local`, `min-masters` or `random`.
    pub const QUEUE_MASTER_LOCATOR: &str = "queue-master-locator";
    /// Per-queue message TTL in milliseconds.
    pub const MESSAGE_TTL: &str = "message-ttl";
    /// Unused-queue expiry in milliseconds.
    pub const EXPIRES: &str = "expires";
    /// Most ready messages a queue holds.
    pub const MAX_LENGTH: &str = "max-length";
    /// Most ready-message body bytes a queue holds.
    pub const MAX_LENGTH_BYTES: &str = "max-length-bytes";
    /// What happens at the length limit.
    pub const OVERFLOW: &str = "overflow";
    /// Exchange that dead-lettered messages are republished to.
    pub const DEAD_LETTER_EXCHANGE: &str = "dead-letter-exchange";
    /// Routing key used when dead-lettering.
    pub const DEAD_LETTER_ROUTING_KEY: &str = "dead-letter-routing-key";
    /// For exchanges: where unroutable messages go.
    pub const ALTERNATE_EXCHANGE: &str = "alternate-exchange";
    /// `default`, or `lazy`: message bodies kept on disk only.
    pub const QUEUE_MODE: &str = "queue-mode";

    /// The ha-* keys, in the order they are validated.
    pub const HA: &[&str] = &[
        HA_MODE,
        HA_PARAMS,
        HA_SYNC_MODE,
        HA_SYNC_BATCH_SIZE,
        HA_PROMOTE_ON_SHUTDOWN,
        HA_PROMOTE_ON_FAILURE,
        HA_MIN_SYNC_REPLICAS,
    ];

    /// Every key a regular policy accepts.
    pub const ALL: &[&str] = &[
        HA_MODE,
        HA_PARAMS,
        HA_SYNC_MODE,
        HA_SYNC_BATCH_SIZE,
        HA_PROMOTE_ON_SHUTDOWN,
        HA_PROMOTE_ON_FAILURE,
        HA_MIN_SYNC_REPLICAS,
        QUEUE_MASTER_LOCATOR,
        MESSAGE_TTL,
        EXPIRES,
        MAX_LENGTH,
        MAX_LENGTH_BYTES,
        OVERFLOW,
        DEAD_LETTER_EXCHANGE,
        DEAD_LETTER_ROUTING_KEY,
        ALTERNATE_EXCHANGE,
        QUEUE_MODE,
    ];

    /// The keys an operator policy accepts (RabbitMQ 3.12's set, restricted to
    /// Warren's keys, plus `ha-min-sync-replicas`).
    pub const OPERATOR: &[&str] = &[
        EXPIRES,
        MESSAGE_TTL,
        MAX_LENGTH,
        MAX_LENGTH_BYTES,
        HA_MODE,
        HA_PARAMS,
        HA_SYNC_MODE,
        HA_MIN_SYNC_REPLICAS,
    ];
}

/// The default `ha-sync-batch-size` when a policy sets none (RabbitMQ's
/// `mirroring_sync_batch_size` default).
pub const DEFAULT_SYNC_BATCH_SIZE: u64 = 4096;

/// Where a queue's mirrors go (`ha-mode` with its `ha-params`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HaMode {
    /// A replica on every running node.
    All,
    /// This many replicas, the master included (`1` = master only).
    Exactly(NonZeroU32),
    /// Replicas on these nodes (those that are running).
    Nodes(Vec<String>),
}

impl HaMode {
    /// The `ha-mode` value: `all`, `exactly` or `nodes`.
    pub fn name(&self) -> &'static str {
        match self {
            HaMode::All => "all",
            HaMode::Exactly(_) => "exactly",
            HaMode::Nodes(_) => "nodes",
        }
    }

    /// The most replicas (master included) the mode keeps once settled:
    /// the count for `exactly`, the number of distinct listed nodes for
    /// `nodes`, no bound for `all`.
    pub fn max_replicas(&self) -> Option<u32> {
        match self {
            HaMode::All => None,
            HaMode::Exactly(n) => Some(n.get()),
            HaMode::Nodes(nodes) => {
                let mut distinct: Vec<&String> = nodes.iter().collect();
                distinct.sort_unstable();
                distinct.dedup();
                Some(u32::try_from(distinct.len()).unwrap_or(u32::MAX))
            }
        }
    }

    /// The `ha-params` value, if the mode takes one.
    pub fn params(&self) -> Option<Value> {
        match self {
            HaMode::All => None,
            HaMode::Exactly(n) => Some(Value::from(n.get())),
            HaMode::Nodes(nodes) => Some(Value::from(nodes.clone())),
        }
    }
}

/// How a new or restarted mirror catches up (`ha-sync-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SyncMode {
    /// Only when an operator asks (`sync_queue`). The default.
    #[default]
    Manual,
    /// As soon as the mirror joins.
    Automatic,
}

impl SyncMode {
    /// The policy value.
    pub fn as_str(self) -> &'static str {
        match self {
            SyncMode::Manual => "manual",
            SyncMode::Automatic => "automatic",
        }
    }
}

/// Which mirrors may be promoted (`ha-promote-on-shutdown` / `ha-promote-on-failure`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PromoteOn {
    /// Any mirror, synchronised or not (messages may be lost).
    Always,
    /// Only a synchronised mirror; otherwise the queue waits for its master.
    WhenSynced,
}

impl PromoteOn {
    /// The policy value.
    pub fn as_str(self) -> &'static str {
        match self {
            PromoteOn::Always => "always",
            PromoteOn::WhenSynced => "when-synced",
        }
    }
}

/// Where a new queue's master goes (`queue-master-locator`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MasterLocator {
    /// The node of the declaring client's connection.
    ClientLocal,
    /// The candidate node hosting the fewest masters.
    MinMasters,
    /// A candidate picked from a caller-supplied seed.
    Random,
}

impl MasterLocator {
    /// The policy value.
    pub fn as_str(self) -> &'static str {
        match self {
            MasterLocator::ClientLocal => "client-local",
            MasterLocator::MinMasters => "min-masters",
            MasterLocator::Random => "random",
        }
    }
}

/// What a queue does at its length limit (`overflow`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Overflow {
    /// Drop (or dead-letter) the oldest message. RabbitMQ's default.
    DropHead,
    /// Refuse the new message (nack it to confirming publishers).
    RejectPublish,
    /// Refuse the new message and dead-letter it.
    RejectPublishDlx,
}

impl Overflow {
    /// The policy value.
    pub fn as_str(self) -> &'static str {
        match self {
            Overflow::DropHead => "drop-head",
            Overflow::RejectPublish => "reject-publish",
            Overflow::RejectPublishDlx => "reject-publish-dlx",
        }
    }
}

/// How a queue keeps its messages (`queue-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QueueMode {
    /// In memory up to the queue's budget, on disk beyond it.
    Default,
    /// On disk only, read back when delivered (a durable queue's).
    Lazy,
}

impl QueueMode {
    /// The policy value.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueMode::Default => "default",
            QueueMode::Lazy => "lazy",
        }
    }
}

/// The mirroring settings of a definition: present exactly when `ha-mode` is.
///
/// The `Option` fields hold what the definition says (`None` = key absent, which
/// matters when merging with an operator policy); the methods of the same name
/// give the effective value with RabbitMQ's default applied.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HaPolicy {
    /// `ha-mode` with `ha-params`.
    pub mode: HaMode,
    /// `ha-sync-mode`, if set.
    pub sync_mode: Option<SyncMode>,
    /// `ha-sync-batch-size`, if set.
    pub sync_batch_size: Option<NonZeroU64>,
    /// `ha-promote-on-shutdown`, if set.
    pub promote_on_shutdown: Option<PromoteOn>,
    /// `ha-promote-on-failure`, if set.
    pub promote_on_failure: Option<PromoteOn>,
    /// `ha-min-sync-replicas`, if set.
    pub min_sync_replicas: Option<NonZeroU32>,
}

impl HaPolicy {
    /// Mirroring in `mode` with every other setting at its default.
    pub fn new(mode: HaMode) -> Self {
        HaPolicy {
            mode,
            sync_mode: None,
            sync_batch_size: None,
            promote_on_shutdown: None,
            promote_on_failure: None,
            min_sync_replicas: None,
        }
    }

    /// The effective sync mode (default `manual`).
    pub fn sync_mode(&self) -> SyncMode {
        self.sync_mode.unwrap_or_default()
    }

    /// The effective batch size: the policy's value, else `default` (the
    /// node's configured size, normally [`DEFAULT_SYNC_BATCH_SIZE`]).
    ///
    /// Unlike RabbitMQ, which ignores a policy value of 1, Warren honours it.
    pub fn sync_batch_size(&self, default: u64) -> u64 {
        self.sync_batch_size.map_or(default, NonZeroU64::get)
    }

    /// The effective promote-on-shutdown rule (default `when-synced`).
    pub fn promote_on_shutdown(&self) -> PromoteOn {
        self.promote_on_shutdown.unwrap_or(PromoteOn::WhenSynced)
    }

    /// The effective promote-on-failure rule (default `always`).
    pub fn promote_on_failure(&self) -> PromoteOn {
        self.promote_on_failure.unwrap_or(PromoteOn::Always)
    }

    /// How many replicas (the master counts as one) must be synchronised for
    /// publisher confirms to be sent (default 1: the master alone).
    pub fn min_sync_replicas(&self) -> u32 {
        self.min_sync_replicas.map_or(1, NonZeroU32::get)
    }
}

/// A validated policy definition.
///
/// Build one with [`Definition::parse`] (or [`Definition::parse_str`]); the
/// public fields let callers read it and build one by hand in tests.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Definition {
    /// Mirroring, present when the definition has `ha-mode`.
    pub ha: Option<HaPolicy>,
    /// `queue-master-locator`.
    pub queue_master_locator: Option<MasterLocator>,
    /// `message-ttl` in milliseconds.
    pub message_ttl: Option<u64>,
    /// `expires` in milliseconds (at least 1).
    pub expires: Option<u64>,
    /// `max-length` in messages.
    pub max_length: Option<u64>,
    /// `max-length-bytes`.
    pub max_length_bytes: Option<u64>,
    /// `overflow`.
    pub overflow: Option<Overflow>,
    /// `dead-letter-exchange`.
    pub dead_letter_exchange: Option<String>,
    /// `dead-letter-routing-key`.
    pub dead_letter_routing_key: Option<String>,
    /// `alternate-exchange` (exchanges only).
    pub alternate_exchange: Option<String>,
    /// `queue-mode`.
    pub queue_mode: Option<QueueMode>,
}

fn render(value: &Value) -> String {
    value.to_string()
}

fn non_negative(value: &Value, err: fn(String) -> DefinitionError) -> Result<u64, DefinitionError> {
    value.as_u64().ok_or_else(|| err(render(value)))
}

fn positive(
    value: &Value,
    err: fn(String) -> DefinitionError,
) -> Result<NonZeroU64, DefinitionError> {
    value
        .as_u64()
        .and_then(NonZeroU64::new)
        .ok_or_else(|| err(render(value)))
}

fn positive_u32(
    value: &Value,
    err: fn(String) -> DefinitionError,
) -> Result<NonZeroU32, DefinitionError> {
    value
        .as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .and_then(NonZeroU32::new)
        .ok_or_else(|| err(render(value)))
}

fn string(value: &Value, err: fn(String) -> DefinitionError) -> Result<String, DefinitionError> {
    value
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| err(render(value)))
}

/// Parses an enumerated string value: `choices` pairs each accepted text with its value.
fn choice<T: Copy>(
    value: &Value,
    choices: &[(&str, T)],
    err: fn(String) -> DefinitionError,
) -> Result<T, DefinitionError> {
    value
        .as_str()
        .and_then(|s| choices.iter().find(|(text, _)| *text == s).map(|(_, v)| *v))
        .ok_or_else(|| err(render(value)))
}

const PROMOTE_CHOICES: &[(&str, PromoteOn)] = &[
    ("always", PromoteOn::Always),
    ("when-synced", PromoteOn::WhenSynced),
];

const SYNC_CHOICES: &[(&str, SyncMode)] = &[
    ("manual", SyncMode::Manual),
    ("automatic", SyncMode::Automatic),
];

const LOCATOR_CHOICES: &[(&str, MasterLocator)] = &[
    ("client-local", MasterLocator::ClientLocal),
    ("min-masters", MasterLocator::MinMasters),
    ("random", MasterLocator::Random),
];

const QUEUE_MODE_CHOICES: &[(&str, QueueMode)] =
    &[("default", QueueMode::Default), ("lazy", QueueMode::Lazy)];

const OVERFLOW_CHOICES: &[(&str, Overflow)] = &[
    ("drop-head", Overflow::DropHead),
    ("reject-publish", Overflow::RejectPublish),
    ("reject-publish-dlx", Overflow::RejectPublishDlx),
];

/// Parses `key` with `parse` when the definition has it.
fn field<T>(
    map: &Map<String, Value>,
    key: &str,
    parse: impl FnOnce(&Value) -> Result<T, DefinitionError>,
) -> Result<Option<T>, DefinitionError> {
    map.get(key).map(parse).transpose()
}

fn parse_mode(mode: &Value, params: Option<&Value>) -> Result<HaMode, DefinitionError> {
    match mode.as_str() {
        Some("all") => match params {
            None => Ok(HaMode::All),
            Some(_) => Err(DefinitionError::AllTakesNoParams),
        },
        Some("exactly") => {
            let params = params.ok_or(DefinitionError::ExactlyNeedsParams)?;
            positive_u32(params, DefinitionError::ExactlyTakesInteger).map(HaMode::Exactly)
        }
        Some("nodes") => {
            let params = params.ok_or(DefinitionError::NodesNeedsParams)?;
            let list = params
                .as_array()
                .ok_or_else(|| DefinitionError::NodesTakesList(render(params)))?;
            if list.is_empty() {
                return Err(DefinitionError::NodesListEmpty);
            }
            let not_strings: Vec<Value> = list.iter().filter(|v| !v.is_string()).cloned().collect();
            if !not_strings.is_empty() {
                return Err(DefinitionError::NodesNotStrings(render(&Value::Array(
                    not_strings,
                ))));
            }
            let nodes = list
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect();
            Ok(HaMode::Nodes(nodes))
        }
        _ => Err(DefinitionError::InvalidHaMode(render(mode))),
    }
}

fn parse_ha(map: &Map<String, Value>) -> Result<Option<HaPolicy>, DefinitionError> {
    let Some(mode) = map.get(keys::HA_MODE) else {
        return match keys::HA.iter().find(|k| map.contains_key(**k)) {
            Some(key) => Err(DefinitionError::HaModeRequired(key)),
            None => Ok(None),
        };
    };
    use DefinitionError as E;
    let ha = HaPolicy {
        mode: parse_mode(mode, map.get(keys::HA_PARAMS))?,
        sync_mode: field(map, keys::HA_SYNC_MODE, |v| {
            choice(v, SYNC_CHOICES, E::InvalidSyncMode)
        })?,
        sync_batch_size: field(map, keys::HA_SYNC_BATCH_SIZE, |v| {
            positive(v, E::InvalidSyncBatchSize)
        })?,
        promote_on_shutdown: field(map, keys::HA_PROMOTE_ON_SHUTDOWN, |v| {
            choice(v, PROMOTE_CHOICES, E::InvalidPromoteOnShutdown)
        })?,
        promote_on_failure: field(map, keys::HA_PROMOTE_ON_FAILURE, |v| {
            choice(v, PROMOTE_CHOICES, E::InvalidPromoteOnFailure)
        })?,
        min_sync_replicas: field(map, keys::HA_MIN_SYNC_REPLICAS, |v| {
            positive_u32(v, E::InvalidMinSyncReplicas)
        })?,
    };
    check_min_sync_reachable(&ha)?;
    Ok(Some(ha))
}

/// Refuses an `ha-min-sync-replicas` that the mode can never satisfy.
fn check_min_sync_reachable(ha: &HaPolicy) -> Result<(), DefinitionError> {
    let min = ha.min_sync_replicas();
    match ha.mode.max_replicas() {
        Some(max) if min > max => Err(DefinitionError::MinSyncReplicasUnreachable {
            min,
            max,
            mode: ha.mode.name(),
        }),
        _ => Ok(()),
    }
}

impl Definition {
    /// Parses and validates a definition for a policy of `kind`.
    ///
    /// Checks, in order: the value is a non-empty object; every key is known
    /// (and, for operator policies, allowed there); the ha-* keys; then the
    /// other keys. The first problem found is returned.
    pub fn parse(kind: PolicyKind, value: &Value) -> Result<Self, DefinitionError> {
        let map = value
            .as_object()
            .ok_or_else(|| DefinitionError::NotAnObject(render(value)))?;
        if map.is_empty() {
            return Err(DefinitionError::Empty);
        }
        let mut unknown: Vec<String> = map
            .keys()
            .filter(|k| !keys::ALL.contains(&k.as_str()))
            .cloned()
            .collect();
        if !unknown.is_empty() {
            unknown.sort();
            return Err(DefinitionError::Unrecognised(unknown));
        }
        if kind == PolicyKind::Operator {
            let mut refused: Vec<String> = map
                .keys()
                .filter(|k| !keys::OPERATOR.contains(&k.as_str()))
                .cloned()
                .collect();
            if !refused.is_empty() {
                refused.sort();
                return Err(DefinitionError::NotOperatorKeys(refused));
            }
        }
        use DefinitionError as E;
        Ok(Definition {
            ha: parse_ha(map)?,
            queue_master_locator: field(map, keys::QUEUE_MASTER_LOCATOR, |v| {
                choice(v, LOCATOR_CHOICES, E::InvalidMasterLocator)
            })?,
            queue_mode: field(map, keys::QUEUE_MODE, |v| {
                choice(v, QUEUE_MODE_CHOICES, E::InvalidQueueMode)
            })?,
            message_ttl: field(map, keys::MESSAGE_TTL, |v| {
                non_negative(v, E::InvalidMessageTtl)
            })?,
            expires: field(map, keys::EXPIRES, |v| {
                positive(v, E::InvalidExpires).map(NonZeroU64::get)
            })?,
            max_length: field(map, keys::MAX_LENGTH, |v| {
                non_negative(v, E::InvalidMaxLength)
            })?,
            max_length_bytes: field(map, keys::MAX_LENGTH_BYTES, |v| {
                non_negative(v, E::InvalidMaxLengthBytes)
            })?,
            overflow: field(map, keys::OVERFLOW, |v| {
                choice(v, OVERFLOW_CHOICES, E::InvalidOverflow)
            })?,
            dead_letter_exchange: field(map, keys::DEAD_LETTER_EXCHANGE, |v| {
                string(v, E::InvalidDeadLetterExchange)
            })?,
            dead_letter_routing_key: field(map, keys::DEAD_LETTER_ROUTING_KEY, |v| {
                string(v, E::InvalidDeadLetterRoutingKey)
            })?,
            alternate_exchange: field(map, keys::ALTERNATE_EXCHANGE, |v| {
                string(v, E::InvalidAlternateExchange)
            })?,
        })
    }

    /// Parses a definition from JSON text, refusing a key that appears twice in
    /// the object (RabbitMQ: "duplicate keys not allowed"; serde_json alone
    /// would silently keep the last).
    pub fn parse_str(kind: PolicyKind, text: &str) -> Result<Self, DefinitionError> {
        let value = parse_json_no_duplicates(text)?;
        Self::parse(kind, &value)
    }

    /// Whether the definition sets mirroring (`ha-mode`).
    pub fn is_mirroring(&self) -> bool {
        self.ha.is_some()
    }

    /// The definition as a JSON object, with only the keys it sets (what
    /// RabbitMQ shows as `effective_policy_definition` for a merged one).
    pub fn to_json(&self) -> Map<String, Value> {
        let mut map = Map::new();
        let mut put = |key: &str, value: Option<Value>| {
            if let Some(value) = value {
                map.insert(key.to_owned(), value);
            }
        };
        if let Some(ha) = &self.ha {
            put(keys::HA_MODE, Some(ha.mode.name().into()));
            put(keys::HA_PARAMS, ha.mode.params());
            put(keys::HA_SYNC_MODE, text(ha.sync_mode, SyncMode::as_str));
            put(
                keys::HA_SYNC_BATCH_SIZE,
                ha.sync_batch_size.map(|n| n.get().into()),
            );
            put(
                keys::HA_PROMOTE_ON_SHUTDOWN,
                text(ha.promote_on_shutdown, PromoteOn::as_str),
            );
            put(
                keys::HA_PROMOTE_ON_FAILURE,
                text(ha.promote_on_failure, PromoteOn::as_str),
            );
            put(
                keys::HA_MIN_SYNC_REPLICAS,
                ha.min_sync_replicas.map(|n| n.get().into()),
            );
        }
        let locator = text(self.queue_master_locator, MasterLocator::as_str);
        put(keys::QUEUE_MASTER_LOCATOR, locator);
        put(keys::MESSAGE_TTL, self.message_ttl.map(Value::from));
        put(keys::EXPIRES, self.expires.map(Value::from));
        put(keys::MAX_LENGTH, self.max_length.map(Value::from));
        put(
            keys::MAX_LENGTH_BYTES,
            self.max_length_bytes.map(Value::from),
        );
        put(keys::OVERFLOW, text(self.overflow, Overflow::as_str));
        put(keys::QUEUE_MODE, text(self.queue_mode, QueueMode::as_str));
        let strings = [
            (keys::DEAD_LETTER_EXCHANGE, &self.dead_letter_exchange),
            (keys::DEAD_LETTER_ROUTING_KEY, &self.dead_letter_routing_key),
            (keys::ALTERNATE_EXCHANGE, &self.alternate_exchange),
        ];
        for (key, value) in strings {
            put(key, value.clone().map(Value::from));
        }
        map
    }

    /// Combines this (regular policy) definition with an operator policy's, as
    /// RabbitMQ's `merge_operator_definitions` does.
    ///
    /// A key set on one side only is taken from that side. A key set on both:
    /// - `message-ttl`, `expires`, `max-length`, `max-length-bytes`: the smaller;
    /// - `ha-mode`: equal modes stay; `all` beats the others; `exactly` beats `nodes`;
    /// - `ha-params` under the same mode: the larger count, or the longer node
    ///   list (a tie takes the operator's);
    /// - `ha-sync-mode`: the operator's;
    /// - `ha-min-sync-replicas` (Warren): the larger, lowered to what the
    ///   merged mode can place ([`HaMode::max_replicas`]).
    ///
    /// Other keys cannot appear in operator policies, so the regular value stands.
    pub fn merge_operator(&self, op: &Definition) -> Definition {
        Definition {
            ha: merge_ha(self.ha.as_ref(), op.ha.as_ref()),
            queue_master_locator: self.queue_master_locator.or(op.queue_master_locator),
            message_ttl: min_of(self.message_ttl, op.message_ttl),
            expires: min_of(self.expires, op.expires),
            max_length: min_of(self.max_length, op.max_length),
            max_length_bytes: min_of(self.max_length_bytes, op.max_length_bytes),
            overflow: self.overflow.or(op.overflow),
            queue_mode: self.queue_mode.or(op.queue_mode),
            dead_letter_exchange: self
                .dead_letter_exchange
                .clone()
                .or_else(|| op.dead_letter_exchange.clone()),
            dead_letter_routing_key: self
                .dead_letter_routing_key
                .clone()
                .or_else(|| op.dead_letter_routing_key.clone()),
            alternate_exchange: self
                .alternate_exchange
                .clone()
                .or_else(|| op.alternate_exchange.clone()),
        }
    }
}

/// An enumerated setting as its JSON text.
fn text<T>(value: Option<T>, as_str: fn(T) -> &'static str) -> Option<Value> {
    value.map(|v| Value::from(as_str(v)))
}

fn min_of(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn merge_mode(regular: &HaMode, op: &HaMode) -> HaMode {
    match (regular, op) {
        (HaMode::All, _) | (_, HaMode::All) => HaMode::All,
        (HaMode::Exactly(a), HaMode::Exactly(b)) => HaMode::Exactly(*a.max(b)),
        (HaMode::Exactly(n), HaMode::Nodes(_)) | (HaMode::Nodes(_), HaMode::Exactly(n)) => {
            HaMode::Exactly(*n)
        }
        (HaMode::Nodes(a), HaMode::Nodes(b)) => HaMode::Nodes(if a.len() > b.len() {
            a.clone()
        } else {
            b.clone()
        }),
    }
}

fn merge_ha(regular: Option<&HaPolicy>, op: Option<&HaPolicy>) -> Option<HaPolicy> {
    let (regular, op) = match (regular, op) {
        (None, None) => return None,
        (Some(one), None) | (None, Some(one)) => return Some(one.clone()),
        (Some(regular), Some(op)) => (regular, op),
    };
    let mode = merge_mode(&regular.mode, &op.mode);
    let min_sync_replicas = match (regular.min_sync_replicas, op.min_sync_replicas) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    // Each side was reachable on its own, but the merged mode may place fewer
    // replicas (e.g. `nodes [A,B]` with 2 under an operator's `exactly 1`):
    // never hold confirms forever because of a merge.
    let min_sync_replicas = match (min_sync_replicas, mode.max_replicas()) {
        (Some(min), Some(max)) if min.get() > max => NonZeroU32::new(max),
        (min, _) => min,
    };
    Some(HaPolicy {
        mode,
        sync_mode: op.sync_mode.or(regular.sync_mode),
        sync_batch_size: regular.sync_batch_size.or(op.sync_batch_size),
        promote_on_shutdown: regular.promote_on_shutdown.or(op.promote_on_shutdown),
        promote_on_failure: regular.promote_on_failure.or(op.promote_on_failure),
        min_sync_replicas,
    })
}

/// A top-level JSON object read entry by entry, so duplicate keys are seen.
struct Entries(Vec<(String, Value)>);

impl<'de> de::Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EntriesVisitor;
        impl<'de> Visitor<'de> for EntriesVisitor {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Entries, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = access.next_entry::<String, Value>()? {
                    entries.push(entry);
                }
                Ok(Entries(entries))
            }
        }
        deserializer.deserialize_map(EntriesVisitor)
    }
}

fn parse_json_no_duplicates(text: &str) -> Result<Value, DefinitionError> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| DefinitionError::Json(e.to_string()))?;
    if !value.is_object() {
        return Ok(value);
    }
    let Entries(entries) =
        serde_json::from_str(text).map_err(|e| DefinitionError::Json(e.to_string()))?;
    let mut seen: Vec<&str> = Vec::with_capacity(entries.len());
    let mut dups: Vec<String> = Vec::new();
    for (key, _) in &entries {
        if seen.contains(&key.as_str()) {
            if !dups.contains(key) {
                dups.push(key.clone());
            }
        } else {
            seen.push(key);
        }
    }
    if dups.is_empty() {
        Ok(value)
    } else {
        dups.sort();
        Err(DefinitionError::DuplicateKeys(dups))
    }
}

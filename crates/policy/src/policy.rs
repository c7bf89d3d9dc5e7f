//! Policies and matching: which policy applies to a queue or an exchange.
//!
//! # Matching rules
//!
//! A policy matches an entity when it is in the same vhost, its `apply-to`
//! fits the entity's kind, and its pattern matches the entity's name. Patterns
//! are **unanchored** as in RabbitMQ (`ha` matches `aha`; write `^ha$` to
//! anchor) and use the [`regex`] crate's syntax, which is PCRE's without
//! look-around and back-references. Each pattern is compiled once, when the
//! [`Policy`] is built.
//!
//! Of the matching policies the one with the **highest priority** applies; at
//! most one regular policy and one operator policy apply to an entity.
//!
//! **Tie-break** (RabbitMQ leaves equal priorities to chance): among matching
//! policies of equal priority, the one whose **name sorts first** (byte order)
//! applies. The result therefore never depends on the order in which policies
//! were set.
//!
//! **Exclusive queues are never mirrored**: a policy still applies to them (for
//! `max-length` and the like), but [`EffectivePolicy::mirroring`] is `None`.

use std::fmt;
use std::str::FromStr;

use regex::Regex;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::definition::{Definition, HaPolicy};
use crate::error::PolicyError;

/// Regular policies (set by users) or operator policies (caps set by operators).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// A policy (`set_policy`).
    Regular,
    /// An operator policy (`set_operator_policy`): limited keys, merged over the regular one.
    Operator,
}

/// Which entities a policy applies to (`apply-to`).
///
/// In JSON it is the `apply-to` string; an unknown one is refused with
/// RabbitMQ's message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "&'static str")]
pub enum ApplyTo {
    /// Queues and exchanges (the default).
    #[default]
    All,
    /// Queues only.
    Queues,
    /// Classic queues only; every Warren queue is a classic queue.
    ClassicQueues,
    /// Exchanges only.
    Exchanges,
}

impl ApplyTo {
    /// The `apply-to` value.
    pub fn as_str(self) -> &'static str {
        match self {
            ApplyTo::All => "all",
            ApplyTo::Queues => "queues",
            ApplyTo::ClassicQueues => "classic_queues",
            ApplyTo::Exchanges => "exchanges",
        }
    }

    /// Whether a policy with this `apply-to` can apply to an entity of `kind`.
    pub fn fits(self, kind: EntityKind) -> bool {
        matches!(
            (self, kind),
            (ApplyTo::All, _)
                | (
                    ApplyTo::Queues | ApplyTo::ClassicQueues,
                    EntityKind::Queue { .. }
                )
                | (ApplyTo::Exchanges, EntityKind::Exchange)
        )
    }
}

impl FromStr for ApplyTo {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Self, PolicyError> {
        match s {
            "all" => Ok(ApplyTo::All),
            "queues" => Ok(ApplyTo::Queues),
            "classic_queues" => Ok(ApplyTo::ClassicQueues),
            "exchanges" => Ok(ApplyTo::Exchanges),
            other => Err(PolicyError::InvalidApplyTo(other.to_owned())),
        }
    }
}

impl TryFrom<String> for ApplyTo {
    type Error = PolicyError;

    fn try_from(s: String) -> Result<Self, PolicyError> {
        s.parse()
    }
}

impl From<ApplyTo> for &'static str {
    fn from(apply_to: ApplyTo) -> Self {
        apply_to.as_str()
    }
}

impl fmt::Display for ApplyTo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Parses a priority given as text (as `rabbitmqctl set_policy --priority` takes it).
pub fn parse_priority(text: &str) -> Result<i64, PolicyError> {
    text.trim()
        .parse()
        .map_err(|_| PolicyError::InvalidPriority(text.to_owned()))
}

/// What a policy can be matched against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EntityKind {
    /// A queue; `exclusive` queues are never mirrored.
    Queue {
        /// Whether the queue is exclusive to its declaring connection.
        exclusive: bool,
    },
    /// An exchange.
    Exchange,
}

/// The unvalidated parts of a policy, as an operator or API supplies them.
///
/// Its JSON form is the management API's: `vhost`, `name`, `pattern`,
/// `apply-to` (default `all`), `priority` (default 0) and `definition`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicySpec {
    /// The vhost the policy belongs to.
    pub vhost: String,
    /// The policy's name, unique per vhost (and kind).
    pub name: String,
    /// The regex over entity names.
    pub pattern: String,
    /// Which entities it applies to.
    #[serde(rename = "apply-to", default)]
    pub apply_to: ApplyTo,
    /// Higher wins; default 0.
    #[serde(default)]
    pub priority: i64,
    /// The definition, a JSON object.
    pub definition: Value,
}

impl PolicySpec {
    /// A spec with `apply-to` `all` and priority 0.
    pub fn new(
        vhost: impl Into<String>,
        name: impl Into<String>,
        pattern: impl Into<String>,
        definition: Value,
    ) -> Self {
        PolicySpec {
            vhost: vhost.into(),
            name: name.into(),
            pattern: pattern.into(),
            apply_to: ApplyTo::All,
            priority: 0,
            definition,
        }
    }

    /// Sets `apply-to`.
    pub fn apply_to(mut self, apply_to: ApplyTo) -> Self {
        self.apply_to = apply_to;
        self
    }

    /// Sets the priority.
    pub fn priority(mut self, priority: i64) -> Self {
        self.priority = priority;
        self
    }
}

/// A validated policy with its compiled pattern.
#[derive(Debug, Clone)]
pub struct Policy {
    kind: PolicyKind,
    vhost: String,
    name: String,
    pattern: Regex,
    apply_to: ApplyTo,
    priority: i64,
    definition: Definition,
    raw_definition: Value,
}

impl Policy {
    /// Validates `spec` as a policy of `kind`: non-empty name, a pattern that
    /// compiles, and a definition valid for that kind.
    pub fn new(kind: PolicyKind, spec: &PolicySpec) -> Result<Self, PolicyError> {
        if spec.name.is_empty() {
            return Err(PolicyError::EmptyName);
        }
        let pattern = Regex::new(&spec.pattern).map_err(|e| PolicyError::InvalidPattern {
            pattern: spec.pattern.clone(),
            reason: e.to_string(),
        })?;
        let definition = Definition::parse(kind, &spec.definition)?;
        Ok(Policy {
            kind,
            vhost: spec.vhost.clone(),
            name: spec.name.clone(),
            pattern,
            apply_to: spec.apply_to,
            priority: spec.priority,
            definition,
            raw_definition: spec.definition.clone(),
        })
    }

    /// A regular policy (see [`Policy::new`]).
    pub fn regular(spec: &PolicySpec) -> Result<Self, PolicyError> {
        Self::new(PolicyKind::Regular, spec)
    }

    /// An operator policy (see [`Policy::new`]).
    pub fn operator(spec: &PolicySpec) -> Result<Self, PolicyError> {
        Self::new(PolicyKind::Operator, spec)
    }

    /// Regular or operator.
    pub fn kind(&self) -> PolicyKind {
        self.kind
    }

    /// The vhost.
    pub fn vhost(&self) -> &str {
        &self.vhost
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The pattern as written.
    pub fn pattern(&self) -> &str {
        self.pattern.as_str()
    }

    /// `apply-to`.
    pub fn apply_to(&self) -> ApplyTo {
        self.apply_to
    }

    /// The priority.
    pub fn priority(&self) -> i64 {
        self.priority
    }

    /// The validated definition.
    pub fn definition(&self) -> &Definition {
        &self.definition
    }

    /// The definition exactly as given (for listing).
    pub fn definition_json(&self) -> &Value {
        &self.raw_definition
    }

    /// The spec this policy was built from (to store or list it).
    pub fn spec(&self) -> PolicySpec {
        PolicySpec {
            vhost: self.vhost.clone(),
            name: self.name.clone(),
            pattern: self.pattern().to_owned(),
            apply_to: self.apply_to,
            priority: self.priority,
            definition: self.raw_definition.clone(),
        }
    }

    /// Whether this policy matches the entity `name` of `kind` in `vhost`.
    pub fn matches(&self, vhost: &str, name: &str, kind: EntityKind) -> bool {
        self.vhost == vhost && self.apply_to.fits(kind) && self.pattern.is_match(name)
    }

    /// True if `self` takes precedence over `other`: higher priority, then the
    /// name that sorts first.
    fn beats(&self, other: &Policy) -> bool {
        self.priority > other.priority
            || (self.priority == other.priority && self.name < other.name)
    }
}

/// Picks the policy that applies: among those matching, the highest priority,
/// ties going to the name that sorts first. `None` if none matches.
pub fn select<'a>(
    policies: impl IntoIterator<Item = &'a Policy>,
    vhost: &str,
    name: &str,
    kind: EntityKind,
) -> Option<&'a Policy> {
    policies
        .into_iter()
        .filter(|p| p.matches(vhost, name, kind))
        .fold(None, |best: Option<&Policy>, p| match best {
            Some(b) if !p.beats(b) => Some(b),
            _ => Some(p),
        })
}

/// What applies to one entity: the chosen regular and operator policies and
/// their merged definition.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EffectivePolicy {
    /// The regular policy's name, if one matched.
    pub policy: Option<String>,
    /// The operator policy's name, if one matched.
    pub operator_policy: Option<String>,
    /// The merged definition (RabbitMQ's `effective_policy_definition`).
    pub definition: Definition,
    /// Whether the entity is an exclusive queue (never mirrored).
    pub exclusive: bool,
}

impl EffectivePolicy {
    /// Combines the chosen policies (either may be absent).
    pub fn from_policies(
        policy: Option<&Policy>,
        operator_policy: Option<&Policy>,
        kind: EntityKind,
    ) -> Self {
        let definition = match (policy, operator_policy) {
            (Some(p), Some(op)) => p.definition().merge_operator(op.definition()),
            (Some(one), None) | (None, Some(one)) => one.definition().clone(),
            (None, None) => Definition::default(),
        };
        EffectivePolicy {
            policy: policy.map(|p| p.name().to_owned()),
            operator_policy: operator_policy.map(|p| p.name().to_owned()),
            definition,
            exclusive: matches!(kind, EntityKind::Queue { exclusive: true }),
        }
    }

    /// The mirroring that applies: `None` when no policy sets `ha-mode`, and
    /// always `None` for exclusive queues.
    pub fn mirroring(&self) -> Option<&HaPolicy> {
        if self.exclusive {
            None
        } else {
            self.definition.ha.as_ref()
        }
    }

    /// Whether the queue is mirrored (possibly with zero mirrors, e.g. `exactly 1`).
    pub fn is_mirrored(&self) -> bool {
        self.mirroring().is_some()
    }
}

/// All policies and operator policies of a cluster, for matching.
#[derive(Debug, Clone, Default)]
pub struct PolicySet {
    regular: Vec<Policy>,
    operator: Vec<Policy>,
}

impl PolicySet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    fn list(&self, kind: PolicyKind) -> &Vec<Policy> {
        match kind {
            PolicyKind::Regular => &self.regular,
            PolicyKind::Operator => &self.operator,
        }
    }

    fn list_mut(&mut self, kind: PolicyKind) -> &mut Vec<Policy> {
        match kind {
            PolicyKind::Regular => &mut self.regular,
            PolicyKind::Operator => &mut self.operator,
        }
    }

    /// Adds `policy`, replacing (and returning) the one of the same kind, vhost and name.
    pub fn set(&mut self, policy: Policy) -> Option<Policy> {
        let list = self.list_mut(policy.kind());
        match list
            .iter_mut()
            .find(|p| p.vhost == policy.vhost && p.name == policy.name)
        {
            Some(slot) => Some(std::mem::replace(slot, policy)),
            None => {
                list.push(policy);
                None
            }
        }
    }

    /// Removes and returns the policy of `kind` named `name` in `vhost`.
    pub fn clear(&mut self, kind: PolicyKind, vhost: &str, name: &str) -> Option<Policy> {
        let list = self.list_mut(kind);
        let index = list
            .iter()
            .position(|p| p.vhost == vhost && p.name == name)?;
        Some(list.remove(index))
    }

    /// The policy of `kind` named `name` in `vhost`.
    pub fn get(&self, kind: PolicyKind, vhost: &str, name: &str) -> Option<&Policy> {
        self.list(kind)
            .iter()
            .find(|p| p.vhost == vhost && p.name == name)
    }

    /// The policies of `kind`, in the order they were first set.
    pub fn iter(&self, kind: PolicyKind) -> impl Iterator<Item = &Policy> {
        self.list(kind).iter()
    }

    /// The effective policy for the entity `name` of `kind` in `vhost`.
    pub fn effective(&self, vhost: &str, name: &str, kind: EntityKind) -> EffectivePolicy {
        let policy = select(&self.regular, vhost, name, kind);
        let operator_policy = select(&self.operator, vhost, name, kind);
        EffectivePolicy::from_policies(policy, operator_policy, kind)
    }

    /// The effective policy for a queue.
    pub fn effective_for_queue(&self, vhost: &str, name: &str, exclusive: bool) -> EffectivePolicy {
        self.effective(vhost, name, EntityKind::Queue { exclusive })
    }

    /// The effective policy for an exchange.
    pub fn effective_for_exchange(&self, vhost: &str, name: &str) -> EffectivePolicy {
        self.effective(vhost, name, EntityKind::Exchange)
    }
}

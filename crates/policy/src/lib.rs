//! Warren's policies: parsing, validation, matching and mirror placement.
//!
//! Pure logic, no I/O, no clock and no randomness of its own: the same inputs
//! always give the same answer.
//!
//! - [`definition`]: the definition keys (`ha-mode`, `ha-params`,
//!   `ha-sync-mode`, …, `max-length`, …), their validation with RabbitMQ's
//!   messages, and the merge of a regular policy with an operator policy.
//! - [`policy`]: [`Policy`] (vhost, name, pattern, apply-to, priority,
//!   definition), [`PolicySet`] and matching: which policy applies to a queue
//!   or exchange ([`EffectivePolicy`]).
//! - [`placement`]: where a queue's mirrors go under `all`, `exactly` and
//!   `nodes`, and the mirrors to add and drop ([`place`]).
//! - [`locator`]: where a new queue's master goes (`queue-master-locator`).
//!
//! # Where Warren decides differently from RabbitMQ
//!
//! - Equal-priority policies: the name that sorts first wins (RabbitMQ: undefined).
//! - Patterns use the `regex` crate (no look-around or back-references).
//! - `apply-to` accepts `all`, `queues`, `classic_queues` and `exchanges`;
//!   Warren has no quorum queues or streams, so those values are refused.
//! - `ha-sync-batch-size: 1` is honoured (RabbitMQ silently uses its default).
//! - `exactly` picks new nodes in a caller-chosen [`CandidateOrder`], not at
//!   random, and replaces mirrors on stopped nodes.
//! - `nodes` migration falls back to the *oldest* synchronised mirror (RabbitMQ:
//!   the first in its synchronisation list).
//! - `ha-min-sync-replicas` (Warren only): positive, default 1, refused when the
//!   mode can never place that many replicas; allowed in operator policies,
//!   where the larger value wins.
//!
//! ```
//! use serde_json::json;
//! use warren_policy::{CandidateOrder, Policy, PolicySet, PolicySpec, PlacementInput, place};
//!
//! let mut set = PolicySet::new();
//! let spec = PolicySpec::new("/", "hello-ha", "^hello", json!({
//!     "ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"
//! }));
//! set.set(Policy::regular(&spec).unwrap());
//!
//! let effective = set.effective_for_queue("/", "hello.world", false);
//! let nodes: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
//! let placement = place(&PlacementInput {
//!     mode: effective.mirroring().map(|ha| &ha.mode),
//!     master: "a",
//!     mirrors: &[],
//!     synchronised: &[],
//!     cluster_nodes: &nodes,
//!     running_nodes: &nodes,
//!     order: CandidateOrder::InOrder,
//! });
//! assert_eq!(placement.add, ["b"]);
//! ```

pub mod definition;
pub mod error;
pub mod locator;
pub mod placement;
pub mod policy;

pub use definition::{
    DEFAULT_SYNC_BATCH_SIZE, Definition, HaMode, HaPolicy, MasterLocator, Overflow, PromoteOn,
    QueueMode, SyncMode,
};
pub use error::{DefinitionError, PolicyError};
pub use locator::{LocateInput, locate_master};
pub use placement::{CandidateOrder, Placement, PlacementInput, place};
pub use policy::{
    ApplyTo, EffectivePolicy, EntityKind, Policy, PolicyKind, PolicySet, PolicySpec,
    parse_priority, select,
};

#[cfg(test)]
mod tests;

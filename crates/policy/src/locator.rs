//! Master placement for a new queue (`queue-master-locator`).
//!
//! Precedence, as RabbitMQ: the queue argument `x-queue-master-locator`, then
//! the policy key, then the node's configured default, then `client-local`.
//! The caller resolves that chain (see [`MasterLocator::from_name`]) and passes
//! the winner to [`locate_master`].

use crate::definition::{HaMode, MasterLocator};
use crate::placement::CandidateOrder;

impl MasterLocator {
    /// Parses a locator name (`client-local`, `min-masters`, `random`); `None`
    /// for anything else.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "client-local" => Some(MasterLocator::ClientLocal),
            "min-masters" => Some(MasterLocator::MinMasters),
            "random" => Some(MasterLocator::Random),
            _ => None,
        }
    }
}

/// What [`locate_master`] needs to know.
#[derive(Debug, Clone, Copy)]
pub struct LocateInput<'a> {
    /// The node of the declaring client's connection.
    pub client_node: &'a str,
    /// Whether the queue is exclusive (always placed on the client's node).
    pub exclusive: bool,
    /// The queue's effective mirroring mode, if any.
    pub mode: Option<&'a HaMode>,
    /// Running nodes that can take a master (not draining).
    pub running_nodes: &'a [String],
    /// How many queue masters each node hosts now; absent nodes host none.
    pub masters_per_node: &'a [(String, usize)],
    /// Seed for `random`.
    pub seed: u64,
}

/// Picks the node for a new queue's master.
///
/// Candidates are the running nodes or, under `ha-mode` `nodes`, the listed
/// nodes that are running (all running nodes if none is). `min-masters` takes
/// the candidate with the fewest masters, ties to the name that sorts first;
/// `random` takes the first candidate in [`CandidateOrder::Seeded`] order.
/// `client-local`, exclusive queues and an empty candidate set give the
/// client's node.
pub fn locate_master(locator: MasterLocator, input: &LocateInput<'_>) -> String {
    if input.exclusive || locator == MasterLocator::ClientLocal {
        return input.client_node.to_owned();
    }
    let running = input.running_nodes.iter().map(String::as_str);
    let mut candidates: Vec<&str> = match input.mode {
        Some(HaMode::Nodes(listed)) => running
            .clone()
            .filter(|n| listed.iter().any(|l| l == n))
            .collect(),
        _ => Vec::new(),
    };
    if candidates.is_empty() {
        candidates = running.collect();
    }
    candidates.sort_unstable();
    candidates.dedup();
    let chosen = match locator {
        MasterLocator::ClientLocal => None,
        MasterLocator::MinMasters => candidates.iter().copied().min_by_key(|n| {
            let count = input
                .masters_per_node
                .iter()
                .find(|(node, _)| node == n)
                .map_or(0, |(_, c)| *c);
            (count, *n)
        }),
        MasterLocator::Random => {
            CandidateOrder::Seeded(input.seed).sort(&mut candidates);
            candidates.first().copied()
        }
    };
    chosen.unwrap_or(input.client_node).to_owned()
}

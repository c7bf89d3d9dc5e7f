//! Mirror placement: from a queue's effective mirroring and the cluster's
//! state, which nodes should hold its replicas, what to add and drop, and
//! whether the master moves. RabbitMQ's `suggested_queue_nodes` per mode,
//! followed by `update_mirrors`' diff.
//!
//! # Rules
//!
//! - **not mirrored** (no `ha-mode`, or an exclusive queue): the master alone;
//!   every mirror is dropped.
//! - **`all`**: a mirror on every running node but the master's.
//! - **`exactly N`**: the master plus `N − 1` mirrors. Current mirrors on
//!   running nodes are kept, oldest first; when there are too few, new ones go
//!   to running nodes without a replica, picked in [`CandidateOrder`]; when the
//!   cluster has fewer running nodes, every one of them gets a mirror. Mirrors
//!   on nodes that are not running are dropped (and so replaced).
//! - **`nodes [..]`**: mirrors on the listed nodes that are known and running;
//!   unknown or stopped ones are ignored. If the master is not listed, it stays
//!   (as master) while no mirror is synchronised; once one is, the master moves
//!   to the first listed node that is a synchronised mirror, or failing that to
//!   the oldest synchronised mirror, and the old master's replica is dropped.
//!   If no listed node runs, the master stays with no mirrors.
//!
//! `all` and `exactly` never move the master. Placement never fails a queue
//! over: if the master's node is down, promotion is the mirror layer's job,
//! and placement keeps naming the current master. Only nodes in
//! `cluster_nodes` are ever proposed for a new replica.

use crate::definition::HaMode;

/// How `exactly` (and the `random` locator) choose among equally good new nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CandidateOrder {
    /// Prefer nodes in the order of `running_nodes` (put the preferred, e.g.
    /// least-loaded, nodes first).
    InOrder,
    /// Rank nodes by a hash of the seed and the node name (rendezvous
    /// hashing). Use a per-queue seed, e.g. a hash of the queue's name, to
    /// spread mirrors; the same seed and nodes always give the same choice, and
    /// a node leaving does not reorder the others.
    Seeded(u64),
}

impl CandidateOrder {
    /// Sorts `nodes` into this order (stable for [`CandidateOrder::InOrder`]).
    pub fn sort(self, nodes: &mut [&str]) {
        if let CandidateOrder::Seeded(seed) = self {
            nodes.sort_by_key(|n| (rank(seed, n), *n));
        }
    }
}

/// FNV-1a over the name, mixed with the seed by splitmix64's finaliser.
fn rank(seed: u64, node: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in node.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let mut z = h ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The state placement works from.
#[derive(Debug, Clone, Copy)]
pub struct PlacementInput<'a> {
    /// The effective mirroring mode; `None` when the queue is not mirrored
    /// (see [`crate::EffectivePolicy::mirroring`]).
    pub mode: Option<&'a HaMode>,
    /// The node of the queue's master.
    pub master: &'a str,
    /// The nodes of the current mirrors, oldest first (join order).
    pub mirrors: &'a [String],
    /// The nodes of the synchronised mirrors (any order; others are ignored).
    pub synchronised: &'a [String],
    /// Every node of the cluster.
    pub cluster_nodes: &'a [String],
    /// The running nodes; those not in `cluster_nodes` are ignored.
    pub running_nodes: &'a [String],
    /// How `exactly` picks new nodes.
    pub order: CandidateOrder,
}

/// Where a queue's replicas should be, and the steps to get there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The master after the change.
    pub master: String,
    /// The mirrors after the change, oldest first: kept ones in their order,
    /// then new ones.
    pub mirrors: Vec<String>,
    /// Nodes to start a new (empty, unsynchronised) mirror on, in order.
    pub add: Vec<String>,
    /// Nodes whose replica to stop: mirrors no longer wanted and, when the
    /// master moves, the old master. Add first, then drop (as RabbitMQ does).
    pub drop: Vec<String>,
    /// Whether the master moves to another node (`nodes` mode only; the new
    /// master is always a synchronised mirror).
    pub master_moves: bool,
}

impl Placement {
    /// Whether nothing needs to change.
    pub fn is_unchanged(&self) -> bool {
        self.add.is_empty() && self.drop.is_empty() && !self.master_moves
    }
}

fn push_unique<'a>(list: &mut Vec<&'a str>, node: &'a str) {
    if !list.contains(&node) {
        list.push(node);
    }
}

/// Computes the target replica set and the diff from the current one.
pub fn place(input: &PlacementInput<'_>) -> Placement {
    let master = input.master;
    let known = |n: &str| input.cluster_nodes.iter().any(|c| c == n);
    let mut running: Vec<&str> = Vec::new();
    for node in input
        .running_nodes
        .iter()
        .map(String::as_str)
        .filter(|n| known(n))
    {
        push_unique(&mut running, node);
    }
    let is_running = |n: &str| running.contains(&n);
    let mut current: Vec<&str> = Vec::new();
    for node in input
        .mirrors
        .iter()
        .map(String::as_str)
        .filter(|n| *n != master)
    {
        push_unique(&mut current, node);
    }
    let synced: Vec<&str> = current
        .iter()
        .copied()
        .filter(|n| is_running(n) && input.synchronised.iter().any(|s| s == n))
        .collect();

    let (new_master, wanted): (&str, Vec<&str>) = match input.mode {
        None => (master, Vec::new()),
        Some(HaMode::All) => (
            master,
            running.iter().copied().filter(|n| *n != master).collect(),
        ),
        Some(HaMode::Exactly(count)) => {
            let want = usize::try_from(count.get() - 1).unwrap_or(usize::MAX);
            let mut chosen: Vec<&str> = current
                .iter()
                .copied()
                .filter(|n| is_running(n))
                .take(want)
                .collect();
            if chosen.len() < want {
                let mut candidates: Vec<&str> = running
                    .iter()
                    .copied()
                    .filter(|n| *n != master && !current.contains(n))
                    .collect();
                input.order.sort(&mut candidates);
                let missing = want - chosen.len();
                chosen.extend(candidates.into_iter().take(missing));
            }
            (master, chosen)
        }
        Some(HaMode::Nodes(listed)) => place_nodes(listed, master, &synced, &running),
    };

    // Target mirrors: kept ones in join order, then new ones in the mode's order.
    let mut mirrors: Vec<&str> = current
        .iter()
        .copied()
        .filter(|n| wanted.contains(n))
        .collect();
    for node in wanted.iter().copied().filter(|n| *n != new_master) {
        push_unique(&mut mirrors, node);
    }
    mirrors.retain(|n| *n != new_master);

    let had_replica = |n: &str| n == master || current.contains(&n);
    let add = mirrors
        .iter()
        .filter(|n| !had_replica(n))
        .map(|n| (*n).to_owned())
        .collect();
    let keeps = |n: &str| n == new_master || mirrors.contains(&n);
    let drop = std::iter::once(master)
        .chain(current.iter().copied())
        .filter(|n| !keeps(n))
        .map(str::to_owned)
        .collect();
    Placement {
        master: new_master.to_owned(),
        mirrors: mirrors.into_iter().map(str::to_owned).collect(),
        add,
        drop,
        master_moves: new_master != master,
    }
}

/// RabbitMQ's `rabbit_mirror_queue_mode_nodes:suggested_queue_nodes`, over
/// known running nodes, with `synced` = running synchronised mirrors oldest first.
fn place_nodes<'a>(
    listed: &'a [String],
    master: &'a str,
    synced: &[&'a str],
    running: &[&'a str],
) -> (&'a str, Vec<&'a str>) {
    let mut policy_nodes: Vec<&str> = Vec::new();
    for node in listed {
        push_unique(&mut policy_nodes, node);
    }
    if synced.is_empty() {
        // Keep the master until some mirror holds its messages.
        push_unique(&mut policy_nodes, master);
    }
    let available: Vec<&str> = policy_nodes
        .into_iter()
        .filter(|n| running.contains(n))
        .collect();
    if available.is_empty() {
        return (master, Vec::new());
    }
    if available.contains(&master) {
        return (
            master,
            available.into_iter().filter(|n| *n != master).collect(),
        );
    }
    let new_master = available
        .iter()
        .copied()
        .find(|n| synced.contains(n))
        .or_else(|| synced.first().copied());
    match new_master {
        Some(new_master) => (
            new_master,
            available.into_iter().filter(|n| *n != new_master).collect(),
        ),
        // The master's node is down and no mirror is synchronised: failover
        // is not placement's business; keep naming the master.
        None => (master, available),
    }
}

//! Property tests: placement never names an unknown node, never drops a
//! running master except to move it onto a synchronised mirror, and always
//! places the right number of mirrors; matching never depends on set order.

use std::collections::BTreeSet;
use std::num::NonZeroU32;

use proptest::prelude::*;
use serde_json::json;

use crate::{
    CandidateOrder, HaMode, Placement, PlacementInput, Policy, PolicySet, PolicySpec, place,
};

const NAMES: &[&str] = &["n0", "n1", "n2", "n3", "n4", "n5", "n6"];

#[derive(Debug, Clone)]
struct World {
    mode: Option<HaMode>,
    master: String,
    mirrors: Vec<String>,
    synced: Vec<String>,
    cluster: Vec<String>,
    running: Vec<String>,
    order: CandidateOrder,
}

impl World {
    fn input(&self) -> PlacementInput<'_> {
        PlacementInput {
            mode: self.mode.as_ref(),
            master: &self.master,
            mirrors: &self.mirrors,
            synchronised: &self.synced,
            cluster_nodes: &self.cluster,
            running_nodes: &self.running,
            order: self.order,
        }
    }
}

fn world() -> impl Strategy<Value = World> {
    (1..=NAMES.len()).prop_flat_map(|size| {
        let cluster: Vec<String> = NAMES[..size].iter().map(|n| (*n).to_owned()).collect();
        // Node names that may appear in inputs: the cluster's plus two strangers.
        let mut pool = cluster.clone();
        pool.extend(["ghost".to_owned(), "n9".to_owned()]);
        let mode = prop_oneof![
            Just(None),
            Just(Some(HaMode::All)),
            (1u32..9).prop_map(|n| Some(HaMode::Exactly(
                NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN)
            ))),
            prop::sample::subsequence(pool.clone(), 1..=pool.len())
                .prop_shuffle()
                .prop_map(|l| Some(HaMode::Nodes(l))),
        ];
        let order = prop_oneof![
            Just(CandidateOrder::InOrder),
            any::<u64>().prop_map(CandidateOrder::Seeded)
        ];
        (
            mode,
            prop::sample::select(cluster.clone()),
            prop::sample::subsequence(pool.clone(), 0..=pool.len()).prop_shuffle(),
            prop::collection::vec(any::<bool>(), pool.len()),
            prop::sample::subsequence(cluster.clone(), 0..=cluster.len()).prop_shuffle(),
            order,
            Just(cluster),
        )
            .prop_map(
                |(mode, master, mirrors, sync_mask, running, order, cluster)| {
                    let synced = mirrors
                        .iter()
                        .zip(&sync_mask)
                        .filter(|(_, s)| **s)
                        .map(|(m, _)| m.clone())
                        .collect();
                    World {
                        mode,
                        master,
                        mirrors,
                        synced,
                        cluster,
                        running,
                        order,
                    }
                },
            )
    })
}

fn set(items: &[String]) -> BTreeSet<&str> {
    items.iter().map(String::as_str).collect()
}

fn check(w: &World, p: &Placement) -> Result<(), TestCaseError> {
    let cluster = set(&w.cluster);
    let running: BTreeSet<&str> = w
        .running
        .iter()
        .map(String::as_str)
        .filter(|n| cluster.contains(n))
        .collect();
    let old: BTreeSet<&str> = std::iter::once(w.master.as_str())
        .chain(w.mirrors.iter().map(String::as_str))
        .collect();
    let mirrors = set(&p.mirrors);

    // Never names an unknown node; new replicas only on running nodes.
    prop_assert!(cluster.contains(p.master.as_str()));
    for n in p.mirrors.iter().chain(&p.add) {
        prop_assert!(
            running.contains(n.as_str()),
            "{n} is not a running cluster node"
        );
    }
    // Well-formed: no duplicates, master not a mirror, diff consistent.
    prop_assert_eq!(mirrors.len(), p.mirrors.len());
    prop_assert!(!mirrors.contains(p.master.as_str()));
    let target: BTreeSet<&str> = mirrors.iter().copied().chain([p.master.as_str()]).collect();
    let add = set(&p.add);
    let drop = set(&p.drop);
    prop_assert_eq!(add.len(), p.add.len());
    prop_assert_eq!(drop.len(), p.drop.len());
    prop_assert!(add.is_disjoint(&old));
    prop_assert!(drop.is_subset(&old));
    prop_assert!(drop.is_disjoint(&target));
    let rebuilt: BTreeSet<&str> = old
        .difference(&drop)
        .copied()
        .chain(add.iter().copied())
        .collect();
    prop_assert_eq!(rebuilt, target);
    prop_assert_eq!(p.master_moves, p.master != w.master);

    // The master is dropped only when it moves, and only onto a running
    // synchronised mirror; only `nodes` moves it.
    if drop.contains(w.master.as_str()) {
        prop_assert!(p.master_moves);
    }
    if p.master_moves {
        prop_assert!(matches!(w.mode, Some(HaMode::Nodes(_))));
        prop_assert!(w.mirrors.contains(&p.master));
        prop_assert!(w.synced.contains(&p.master));
        prop_assert!(running.contains(p.master.as_str()));
    }

    // The right count.
    let others: BTreeSet<&str> = running.iter().copied().filter(|n| *n != w.master).collect();
    match &w.mode {
        None => prop_assert!(p.mirrors.is_empty()),
        Some(HaMode::All) => prop_assert_eq!(mirrors, others),
        Some(HaMode::Exactly(n)) => {
            let want = (n.get() as usize - 1).min(others.len());
            prop_assert_eq!(p.mirrors.len(), want);
            // Current running mirrors are preferred, oldest first.
            let kept: Vec<&String> = w
                .mirrors
                .iter()
                .filter(|m| **m != w.master && running.contains(m.as_str()))
                .take(want)
                .collect();
            for m in kept {
                prop_assert!(
                    mirrors.contains(m.as_str()),
                    "current mirror {m} was not kept"
                );
            }
        }
        Some(HaMode::Nodes(listed)) => {
            let listed = set(listed);
            prop_assert!(mirrors.is_subset(&listed));
            if !p.master_moves
                && w.synced
                    .iter()
                    .all(|s| !running.contains(s.as_str()) || !w.mirrors.contains(s))
            {
                // Nothing synchronised: every listed running node but the master holds a mirror.
                let want: BTreeSet<&str> = listed.intersection(&others).copied().collect();
                prop_assert_eq!(mirrors, want);
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn placement_invariants(w in world()) {
        let p = place(&w.input());
        check(&w, &p)?;
        // Deterministic.
        prop_assert_eq!(&place(&w.input()), &p);
        // Applying the placement and asking again changes nothing more
        // (a `nodes` migration may take more than one step).
        if !p.master_moves {
            let next = World {
                mirrors: p.mirrors.clone(),
                synced: w.synced.iter().filter(|s| p.mirrors.contains(s)).cloned().collect(),
                ..w.clone()
            };
            let again = place(&next.input());
            prop_assert!(again.is_unchanged(), "not stable: {:?} then {:?}", p, again);
        }
    }

    #[test]
    fn matching_ignores_insertion_order(
        priorities in prop::collection::vec(-2i64..3, 1..6),
        rotate in 0usize..6,
    ) {
        let policies: Vec<Policy> = priorities
            .iter()
            .enumerate()
            .map(|(i, prio)| {
                let spec = PolicySpec::new("/", format!("p{i}"), ".*", json!({"max-length": i}))
                    .priority(*prio);
                Policy::regular(&spec).map_err(|e| TestCaseError::fail(e.to_string()))
            })
            .collect::<Result<_, _>>()?;
        let mut rotated = policies.clone();
        rotated.rotate_left(rotate % policies.len());
        let pick = |ps: &[Policy]| {
            let mut s = PolicySet::new();
            for p in ps {
                s.set(p.clone());
            }
            s.effective_for_queue("/", "q", false).policy
        };
        let best = pick(&policies);
        prop_assert_eq!(&best, &pick(&rotated));
        let top = priorities.iter().max().copied().unwrap_or_default();
        let first_top = priorities.iter().position(|p| *p == top).map(|i| format!("p{i}"));
        prop_assert_eq!(best, first_top);
    }
}

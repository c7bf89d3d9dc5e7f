//! queue-master-locator: where a new queue's master goes.

use super::nodes;
use crate::{HaMode, LocateInput, MasterLocator, locate_master};

fn input<'a>(
    running: &'a [String],
    counts: &'a [(String, usize)],
    mode: Option<&'a HaMode>,
) -> LocateInput<'a> {
    LocateInput {
        client_node: "A",
        exclusive: false,
        mode,
        running_nodes: running,
        masters_per_node: counts,
        seed: 1,
    }
}

#[test]
fn locator_names() {
    for l in [
        MasterLocator::ClientLocal,
        MasterLocator::MinMasters,
        MasterLocator::Random,
    ] {
        assert_eq!(MasterLocator::from_name(l.as_str()), Some(l));
    }
    assert_eq!(MasterLocator::from_name("balanced"), None);
}

#[test]
fn client_local_and_exclusive_use_the_client_node() {
    let running = nodes(&["A", "B", "C"]);
    let counts = vec![("A".to_owned(), 9)];
    assert_eq!(
        locate_master(MasterLocator::ClientLocal, &input(&running, &counts, None)),
        "A"
    );
    let exclusive = LocateInput {
        exclusive: true,
        ..input(&running, &counts, None)
    };
    assert_eq!(locate_master(MasterLocator::MinMasters, &exclusive), "A");
}

#[test]
fn min_masters_picks_the_least_loaded() {
    // Scenario 20: A hosts 3 masters, B 1, C none.
    let running = nodes(&["A", "B", "C"]);
    let counts = vec![("A".to_owned(), 3), ("B".to_owned(), 1)];
    assert_eq!(
        locate_master(MasterLocator::MinMasters, &input(&running, &counts, None)),
        "C"
    );
    // Ties go to the name that sorts first.
    let counts = vec![
        ("A".to_owned(), 1),
        ("B".to_owned(), 0),
        ("C".to_owned(), 0),
    ];
    assert_eq!(
        locate_master(MasterLocator::MinMasters, &input(&running, &counts, None)),
        "B"
    );
    // Under ha-mode nodes only listed running nodes are candidates.
    let mode = HaMode::Nodes(nodes(&["A", "B", "Z"]));
    let counts = vec![("A".to_owned(), 3), ("B".to_owned(), 1)];
    assert_eq!(
        locate_master(
            MasterLocator::MinMasters,
            &input(&running, &counts, Some(&mode))
        ),
        "B"
    );
    // No listed node runs: every running node is a candidate.
    let mode = HaMode::Nodes(nodes(&["Z"]));
    assert_eq!(
        locate_master(
            MasterLocator::MinMasters,
            &input(&running, &counts, Some(&mode))
        ),
        "C"
    );
    // No candidates at all: the client's node.
    assert_eq!(
        locate_master(MasterLocator::MinMasters, &input(&[], &counts, None)),
        "A"
    );
}

#[test]
fn random_is_seeded() {
    let running = nodes(&["A", "B", "C", "D"]);
    let base = input(&running, &[], None);
    let picks: std::collections::BTreeSet<String> = (0..40)
        .map(|seed| {
            let i = LocateInput { seed, ..base };
            let first = locate_master(MasterLocator::Random, &i);
            assert_eq!(first, locate_master(MasterLocator::Random, &i));
            assert!(running.contains(&first));
            first
        })
        .collect();
    assert!(picks.len() > 1, "seeds should spread masters");
    assert_eq!(
        locate_master(MasterLocator::Random, &input(&[], &[], None)),
        "A"
    );
}

//! The [`RecordStore`] conformance suite: [`record_store`], run by this
//! crate's tests on [`ClusterRecords`](crate::ClusterRecords) over
//! [`MemMetadata`](crate::MemMetadata) and over a Raft
//! [`Cluster`](warren_cluster::Cluster).

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use warren_mirror::RecordView;

use crate::{RecordError, RecordStore};

/// The longest a single step of the suite may take before it counts as a hang.
pub const STEP_LIMIT: Duration = Duration::from_secs(20);

/// Awaits `fut`, panicking (naming `what`) if it takes longer than [`STEP_LIMIT`].
async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(STEP_LIMIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what} hung for more than {STEP_LIMIT:?}"),
    }
}

/// The nodes the suite places replicas on.
const NODES: [&str; 4] = ["n1", "n2", "n3", "n4"];

/// A valid placement drawn from `rng`: a master, some other nodes as
/// mirrors, some of those synchronised.
fn placement(rng: &mut StdRng) -> RecordView {
    let mut nodes = NODES.map(str::to_owned).to_vec();
    nodes.shuffle(rng);
    let master = nodes.remove(0);
    nodes.truncate(rng.random_range(0..=nodes.len()));
    let synchronised = nodes
        .iter()
        .filter(|_| rng.random_bool(0.5))
        .cloned()
        .collect();
    RecordView {
        version: 0,
        master,
        mirrors: nodes,
        synchronised,
    }
}

fn same_placement(a: &RecordView, b: &RecordView) -> bool {
    a.master == b.master && a.mirrors == b.mirrors && a.synchronised == b.synchronised
}

/// Checks the [`RecordStore`] contract on `store`, the record of a queue
/// that exists (any placement, any version):
///
/// - `compare_and_set` at the record's version sets the placement (the
///   version inside `view` is ignored) and the version grows by exactly one;
///   what it returns, `local` answers once the change has reached this
///   node, and a `changes` receiver taken before sees a change;
/// - at any other version it is [`RecordError::Conflict`] with the current
///   record, and changes nothing;
/// - a placement the store refuses (the master also a mirror, a mirror
///   twice, a synchronised node that is no mirror) is an error other than a
///   conflict, and changes nothing;
/// - a seeded random run of placements ends where they say;
/// - of stores racing at one version (tasks on the caller's runtime),
///   exactly one wins and the others get the winner's record as the conflict.
pub async fn record_store<S: RecordStore + 'static>(store: Arc<S>, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let s = store.as_ref();
    let start = s.local().expect("the queue's record exists");

    // One compare-and-set, seen by `changes` and `local`.
    let mut changes = s.changes();
    changes.borrow_and_update();
    let mut want = placement(&mut rng);
    want.version = 12_345;
    let got = within("compare_and_set", s.compare_and_set(start.version, &want))
        .await
        .expect("a compare-and-set at the record's version");
    assert_eq!(got.version, start.version + 1, "the version grows by one");
    assert!(same_placement(&got, &want), "{got:?} is not {want:?}");
    within("a change notice", changes.changed())
        .await
        .expect("the store still runs");
    let local = settled(s, &got).await;
    assert_eq!(local, got);

    // Stale versions.
    for stale in [start.version, got.version + 1] {
        let other = placement(&mut rng);
        match within("compare_and_set", s.compare_and_set(stale, &other)).await {
            Err(RecordError::Conflict(current)) => {
                assert_eq!(current, got, "the conflict's record")
            }
            other => panic!(
                "a compare-and-set at {stale} of a record at {}: {other:?}",
                got.version
            ),
        }
    }

    // Refused placements.
    let refused = [
        RecordView {
            version: 0,
            master: "n1".into(),
            mirrors: vec!["n1".into()],
            synchronised: vec![],
        },
        RecordView {
            version: 0,
            master: "n1".into(),
            mirrors: vec!["n2".into(), "n2".into()],
            synchronised: vec![],
        },
        RecordView {
            version: 0,
            master: "n1".into(),
            mirrors: vec!["n2".into()],
            synchronised: vec!["n3".into()],
        },
    ];
    for bad in &refused {
        match within("compare_and_set", s.compare_and_set(got.version, bad)).await {
            Err(RecordError::Unavailable(_)) => {}
            other => panic!("{bad:?} was not refused: {other:?}"),
        }
    }
    assert_eq!(
        s.local().expect("the record"),
        got,
        "a refusal changes nothing"
    );

    // A seeded random run.
    let mut at = got;
    for step in 0..20 {
        let want = placement(&mut rng);
        let next = within("compare_and_set", s.compare_and_set(at.version, &want))
            .await
            .unwrap_or_else(|e| panic!("step {step} (seed {seed}): {e}"));
        assert_eq!(next.version, at.version + 1, "step {step} (seed {seed})");
        assert!(same_placement(&next, &want), "step {step} (seed {seed})");
        at = next;
    }
    let at = settled(s, &at).await;

    // Racers at one version.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let store = store.clone();
        let want = placement(&mut rng);
        let version = at.version;
        tasks.spawn(async move { store.compare_and_set(version, &want).await });
    }
    let mut winners = Vec::new();
    let mut losers = Vec::new();
    while let Some(r) = within("racing compare-and-sets", tasks.join_next()).await {
        match r.expect("a racer panicked") {
            Ok(v) => winners.push(v),
            Err(RecordError::Conflict(v)) => losers.push(v),
            Err(e) => panic!("a racer: {e}"),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one racer wins: {winners:?}");
    let winner = &winners[0];
    assert_eq!(winner.version, at.version + 1);
    assert!(
        losers.iter().all(|l| l == winner),
        "every loser sees the winner's record: {losers:?} against {winner:?}"
    );
}

/// Waits until `local` answers `want` (a change reaches this node's copy
/// when it is applied here), and returns it.
async fn settled<S: RecordStore + ?Sized>(store: &S, want: &RecordView) -> RecordView {
    within("the change reaching local", async {
        loop {
            let local = store.local().expect("the record");
            assert!(
                local.version <= want.version,
                "local ran ahead of the store"
            );
            if local == *want {
                return local;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
}

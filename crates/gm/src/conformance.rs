//! Conformance suites for GM's two contracts: [`view_authority`] for a
//! [`ViewAuthority`] and [`failure_detector`] for a [`FailureDetector`].
//!
//! Each implementation's tests call the suite with a seed (the random
//! parts are drawn from it, so a failure replays). `InMemoryAuthority` and
//! `HeartbeatDetector` run them in this crate's tests; the cluster-backed
//! implementations in `warren-mirror-driver`'s.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;
use warren_wire::NodeName;

use crate::view::{MemberId, View, ViewChange, ViewError};
use crate::{FailureDetector, ViewAuthority};

/// The longest a single step of a suite may take before it counts as a hang.
pub const STEP_LIMIT: Duration = Duration::from_secs(20);

/// Awaits `fut`, panicking (naming `what`) if it takes longer than [`STEP_LIMIT`].
async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(STEP_LIMIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what} hung for more than {STEP_LIMIT:?}"),
    }
}

fn node(i: u64) -> NodeName {
    NodeName::new(format!("n{i}@conformance")).expect("suite node names are valid")
}

fn join(member: u64, after: Option<MemberId>) -> ViewChange {
    ViewChange::Join {
        member: MemberId(member),
        after,
        node: node(member % 3),
    }
}

/// Checks the [`ViewAuthority`] contract on `authority`, using rings whose
/// names start with `prefix` (give each run on one authority its own):
///
/// - a ring nobody touched is at [`View::empty`], and rings are independent;
/// - `update` at the current version applies the change (as
///   [`View::apply`] does) and the version grows by exactly one; what it
///   returns is what `current` answers next;
/// - `update` at any other version is [`ViewError::Conflict`] naming the
///   expected and the current version, and changes nothing;
/// - a change the view refuses is that error, and changes nothing;
/// - a seeded random run of changes ends where a model applying them ends;
/// - proposers racing on one ring (tasks on the caller's runtime) each
///   commit exactly once: every success is one version, nothing is lost;
/// - `current_local` never runs ahead of `current`, and catches up.
pub async fn view_authority<A: ViewAuthority + 'static>(
    authority: Arc<A>,
    prefix: &str,
    seed: u64,
) {
    let ring = format!("{prefix}-ring");
    let other = format!("{prefix}-other");
    let a = authority.as_ref();
    let current = |r: &str| {
        let r = r.to_owned();
        async move {
            within("current", a.current(&r))
                .await
                .expect("current answers")
        }
    };

    // Untouched rings.
    assert_eq!(current(&ring).await, View::empty(), "an untouched ring");
    let local = within("current_local", a.current_local(&ring)).await;
    assert_eq!(local, Ok(View::empty()), "an untouched ring, locally");

    // Compare-and-set.
    let v1 = within("update", a.update(&ring, 0, join(1, None)))
        .await
        .expect("the first join at version 0");
    assert_eq!(v1, View::empty().apply(&join(1, None)).unwrap());
    assert_eq!(v1.version, 1);
    assert_eq!(current(&ring).await, v1, "current after an update");
    for stale in [0, 5] {
        let got = within("update", a.update(&ring, stale, join(2, Some(MemberId(1))))).await;
        assert_eq!(
            got,
            Err(ViewError::Conflict {
                expected: stale,
                current: 1
            }),
            "an update at version {stale} of a ring at 1"
        );
    }
    assert_eq!(current(&ring).await, v1, "a conflict changes nothing");

    // Refused changes.
    for (change, error) in [
        (join(3, None), ViewError::RingNotEmpty),
        (
            join(1, Some(MemberId(1))),
            ViewError::AlreadyMember(MemberId(1)),
        ),
        (join(3, Some(MemberId(9))), ViewError::NotAlive(MemberId(9))),
        (
            ViewChange::Erase(MemberId(1)),
            ViewError::NotDead(MemberId(1)),
        ),
    ] {
        let got = within("update", a.update(&ring, 1, change.clone())).await;
        assert_eq!(got, Err(error), "{change:?} refused");
    }
    assert_eq!(current(&ring).await, v1, "a refused change changes nothing");
    assert_eq!(
        current(&other).await,
        View::empty(),
        "rings are independent"
    );

    // A seeded random run against a model.
    let mut rng = StdRng::seed_from_u64(seed);
    let mut model = v1;
    let mut next_id = 2;
    for step in 0..40 {
        let alive: Vec<MemberId> = model.alive().collect();
        let dead: Vec<MemberId> = model
            .entries
            .iter()
            .filter(|e| !e.alive)
            .map(|e| e.id)
            .collect();
        let change = match rng.random_range(0..4) {
            0 | 1 if !alive.is_empty() => {
                next_id += 1;
                join(next_id, Some(alive[rng.random_range(0..alive.len())]))
            }
            0 | 1 => {
                next_id += 1;
                join(next_id, None)
            }
            2 if alive.len() > 1 => ViewChange::Remove(alive[rng.random_range(0..alive.len())]),
            2 | 3 if !dead.is_empty() => ViewChange::Erase(dead[rng.random_range(0..dead.len())]),
            // Refused: an erase of a member that is alive, or of none.
            _ => ViewChange::Erase(alive.first().copied().unwrap_or(MemberId(999))),
        };
        let want = model.apply(&change);
        let got = within("update", a.update(&ring, model.version, change.clone())).await;
        assert_eq!(got, want, "step {step} (seed {seed}): {change:?}");
        if let Ok(v) = got {
            model = v;
        }
    }
    assert_eq!(current(&ring).await, model, "after the run (seed {seed})");

    // Racing proposers: each joins once, retrying on conflict.
    let racers = 4u64;
    let before = current(&ring).await;
    let first = next_id + 1;
    let mut tasks = tokio::task::JoinSet::new();
    for id in first..first + racers {
        let authority = authority.clone();
        let ring = ring.clone();
        tasks.spawn(async move {
            loop {
                let now = authority.current(&ring).await.expect("current answers");
                let after = now.alive().last();
                match authority.update(&ring, now.version, join(id, after)).await {
                    Ok(v) => return v.version,
                    Err(ViewError::Conflict { .. }) => tokio::task::yield_now().await,
                    Err(e) => panic!("racer {id}: {e}"),
                }
            }
        });
    }
    let mut versions = BTreeSet::new();
    while let Some(v) = within("racing proposers", tasks.join_next()).await {
        assert!(
            versions.insert(v.expect("a racer panicked")),
            "two proposers committed the same version"
        );
    }
    let expected: BTreeSet<u64> = (1..=racers).map(|k| before.version + k).collect();
    assert_eq!(versions, expected, "one version per commit, none skipped");
    let after = current(&ring).await;
    for id in first..first + racers {
        assert!(after.is_alive(MemberId(id)), "racer {id} is in the view");
    }

    // current_local: never ahead, catches up.
    within("current_local to catch up", async {
        loop {
            let local = a.current_local(&ring).await.expect("current_local answers");
            assert!(local.version <= after.version, "current_local ran ahead");
            if local == after {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// What [`failure_detector`] needs to drive one kind of [`FailureDetector`].
pub trait DetectorHarness {
    /// The detector under test.
    type Detector: FailureDetector;
    /// A fresh detector.
    fn detector(&mut self) -> Self::Detector;
    /// Says `peer` is alive at `now`, the way this detector learns it (a
    /// frame heard, the cluster seeing the node up).
    fn alive(&mut self, detector: &mut Self::Detector, peer: &NodeName, now: Instant);
    /// From now on nothing says `peer` is alive, until [`alive`](Self::alive).
    fn dead(&mut self, peer: &NodeName);
    /// How long after the last sign of life a dead peer (that was seen
    /// alive) is suspected at the latest.
    fn suspicion_after(&self) -> Duration;
    /// The interval between heartbeats.
    fn heartbeat_interval(&self) -> Duration;
}

/// Checks the [`FailureDetector`] contract (time is an input: the suite
/// makes its instants, nothing sleeps):
///
/// - `heartbeat_due` is true at the first call and then whenever the
///   heartbeat interval has passed since it was last true, else false;
/// - over a seeded random schedule of peers dying and coming back, a peer is
///   suspected only while dead, at most once per death, and surely once it
///   has been dead for [`DetectorHarness::suspicion_after`], a death right
///   after a return that no poll saw included (a restart that died at once);
/// - a peer never watched is never suspected.
pub fn failure_detector<H: DetectorHarness>(harness: &mut H, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let t0 = Instant::now();
    let interval = harness.heartbeat_interval();
    let limit = harness.suspicion_after();

    // Heartbeats.
    let mut d = harness.detector();
    assert!(d.heartbeat_due(t0), "the first heartbeat is due at once");
    assert!(!d.heartbeat_due(t0), "not twice at one instant");
    let mut last = t0;
    let mut now = t0;
    for step in 0..200 {
        now += interval.mul_f64(rng.random_range(0.0..0.7));
        let want = now - last >= interval;
        assert_eq!(
            d.heartbeat_due(now),
            want,
            "heartbeat at step {step} (seed {seed}), {:?} after the last",
            now - last
        );
        if want {
            last = now;
        }
    }

    // Suspicions.
    let mut d = harness.detector();
    let peers: Vec<NodeName> = (1..=4).map(node).collect();
    let stranger = node(99);
    let mut now = t0;
    // Per peer: dead since (its last sign of life), and reported since.
    let mut dead_since: Vec<Option<Instant>> = vec![None; peers.len()];
    let mut reported = vec![false; peers.len()];
    for p in &peers {
        harness.alive(&mut d, p, now);
        d.watch(p, now);
    }
    for step in 0..400 {
        now += limit.mul_f64(rng.random_range(0.0..0.3));
        for (i, p) in peers.iter().enumerate() {
            match (dead_since[i], rng.random_range(0..10)) {
                (None, 0) => {
                    harness.dead(p);
                    dead_since[i] = Some(now);
                }
                (Some(_), 0) => {
                    dead_since[i] = None;
                    reported[i] = false;
                }
                // Back and dead again before the next poll.
                (Some(_), 1) => {
                    harness.alive(&mut d, p, now);
                    harness.dead(p);
                    dead_since[i] = Some(now);
                    reported[i] = false;
                }
                _ => {}
            }
            if dead_since[i].is_none() {
                harness.alive(&mut d, p, now);
            }
        }
        let suspects = d.poll_suspects(now);
        assert!(
            !suspects.contains(&stranger),
            "a peer never watched was suspected (seed {seed})"
        );
        for s in &suspects {
            let i = peers.iter().position(|p| p == s).expect("a watched peer");
            assert!(
                dead_since[i].is_some(),
                "step {step} (seed {seed}): {s} suspected while alive"
            );
            assert!(
                !reported[i],
                "step {step} (seed {seed}): {s} suspected twice for one death"
            );
            reported[i] = true;
        }
        for (i, p) in peers.iter().enumerate() {
            if let Some(since) = dead_since[i] {
                assert!(
                    reported[i] || now - since < limit,
                    "step {step} (seed {seed}): {p} dead for {:?} and not suspected",
                    now - since
                );
            }
        }
    }
}

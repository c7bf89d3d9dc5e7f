//! Who decides the view: the [`ViewAuthority`] trait and an in-process implementation.
//!
//! gm.erl is correct only because every membership change is totally ordered
//! (its Lemma 1); it gets that order from Mnesia transactions. Warren gets it
//! from a compare-and-set on the view version, so that the Raft metadata store
//! can back it later. The GM core never calls the authority itself: it emits
//! [`Action`](crate::Action)s and the driver (or the simulator) proposes.

use std::collections::BTreeMap;
use std::sync::Mutex;

use async_trait::async_trait;

use crate::view::{View, ViewChange, ViewError, ViewVersion};

/// The keeper of every ring's view: reads and compare-and-set updates.
///
/// Contract: for each ring, versions grow by exactly one per successful
/// update; `update` applies `change` only if the ring is still at `expected`
/// (else [`ViewError::Conflict`] naming both versions), so all changes to a
/// ring are totally ordered, however many proposers race. A change the view
/// refuses ([`View::apply`]) is that error and changes nothing. A ring nobody
/// has touched is at [`View::empty`]; rings are independent.
/// `current_local` never runs ahead of `current` and catches up with it.
/// The suite `conformance::view_authority` (feature `conformance`) checks
/// all of this.
#[async_trait]
pub trait ViewAuthority: Send + Sync {
    /// The ring's current view.
    async fn current(&self, ring: &str) -> Result<View, ViewError>;
    /// The ring's view as this node last learned it, without asking anyone:
    /// for the driver's periodic safety-net poll, where a stale answer only
    /// waits for the next poll. The default asks [`current`](Self::current).
    async fn current_local(&self, ring: &str) -> Result<View, ViewError> {
        self.current(ring).await
    }
    /// Applies `change` if the ring is at version `expected`; returns the new view.
    async fn update(
        &self,
        ring: &str,
        expected: ViewVersion,
        change: ViewChange,
    ) -> Result<View, ViewError>;
}

/// An in-process [`ViewAuthority`] (a map behind a mutex), for tests and single-node use.
#[derive(Debug, Default)]
pub struct InMemoryAuthority {
    rings: Mutex<BTreeMap<String, View>>,
}

impl InMemoryAuthority {
    /// An authority with no rings.
    pub fn new() -> Self {
        Self::default()
    }

    fn rings(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, View>> {
        // A panic elsewhere while holding the lock leaves the map consistent
        // (every write is a single insert), so a poisoned lock is still usable.
        self.rings.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The ring's current view, synchronously.
    pub fn current_now(&self, ring: &str) -> View {
        self.rings().get(ring).cloned().unwrap_or_else(View::empty)
    }

    /// Compare-and-set, synchronously (see [`ViewAuthority::update`]).
    pub fn update_now(
        &self,
        ring: &str,
        expected: ViewVersion,
        change: &ViewChange,
    ) -> Result<View, ViewError> {
        let mut rings = self.rings();
        let current = rings.get(ring).cloned().unwrap_or_else(View::empty);
        if current.version != expected {
            return Err(ViewError::Conflict {
                expected,
                current: current.version,
            });
        }
        let next = current.apply(change)?;
        rings.insert(ring.to_owned(), next.clone());
        Ok(next)
    }

    /// Reads, applies and retries on conflict until `change` commits or is refused.
    pub fn propose_now(&self, ring: &str, change: &ViewChange) -> Result<View, ViewError> {
        loop {
            let current = self.current_now(ring);
            match self.update_now(ring, current.version, change) {
                Err(ViewError::Conflict { .. }) => continue,
                other => return other,
            }
        }
    }
}

#[async_trait]
impl ViewAuthority for InMemoryAuthority {
    async fn current(&self, ring: &str) -> Result<View, ViewError> {
        Ok(self.current_now(ring))
    }

    async fn update(
        &self,
        ring: &str,
        expected: ViewVersion,
        change: ViewChange,
    ) -> Result<View, ViewError> {
        self.update_now(ring, expected, &change)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::MemberId;

    #[test]
    fn compare_and_set_orders_changes() {
        let auth = InMemoryAuthority::new();
        let join = |n, after| ViewChange::Join {
            member: MemberId(n),
            after,
            node: warren_wire::NodeName::new("n@test").unwrap(),
        };
        let v1 = auth.update_now("q", 0, &join(1, None)).unwrap();
        assert_eq!(v1.version, 1);
        let stale = auth.update_now("q", 0, &join(2, Some(MemberId(1))));
        assert_eq!(
            stale,
            Err(ViewError::Conflict {
                expected: 0,
                current: 1
            })
        );
        let v2 = auth.propose_now("q", &join(2, Some(MemberId(1)))).unwrap();
        assert_eq!(v2.version, 2);
        assert_eq!(auth.current_now("other").version, 0);
    }
}

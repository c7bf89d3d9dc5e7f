//! What publishes a copy of a queue holds: the record by which a master
//! (or a queue served alone from its local store) takes a publish sent
//! again only once.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::wire::PublishId;

/// The highest sequence number held per publisher, and whether that lists
/// every publish the copy holds. A publisher's publishes reach a copy in
/// order, so holding `(p, s)` means holding every earlier publish of `p`
/// that reached it.
///
/// A new copy's record is complete ([`HeldPublishes::new`]). A copy
/// recovered from disk has none ([`HeldPublishes::unknown`]): it may hold
/// publishes of any publisher, so a publish sent again is known only for a
/// publisher heard from since.
///
/// It names at most [`HELD_PUBLISHERS_MAX`] publishers: past that it forgets
/// those it heard from least recently, and is no longer complete. Each link
/// session and each node start brings a new publisher, and only a recent
/// one sends a publish again; one forgotten is refused, never taken twice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldPublishes {
    /// Per publisher: the highest seq held, and when it was noted (`clock`).
    highest: BTreeMap<u64, (u64, u64)>,
    /// Counts the notes, to tell the publishers heard from least recently.
    clock: u64,
    complete: bool,
}

/// The publishers a [`HeldPublishes`] names at most; it forgets half of
/// them at once, those heard from least recently.
pub const HELD_PUBLISHERS_MAX: usize = 2048;

/// Whether a copy holds a publish ([`HeldPublishes::holds`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holds {
    /// It holds it.
    Yes,
    /// It does not.
    No,
    /// It cannot tell: its record is not complete and names nothing of the
    /// publisher.
    Unknown,
}

impl Default for HeldPublishes {
    fn default() -> Self {
        Self::new()
    }
}

impl HeldPublishes {
    /// The record of a new, empty copy: it holds nothing.
    pub fn new() -> Self {
        Self {
            highest: BTreeMap::new(),
            clock: 0,
            complete: true,
        }
    }

    /// The record of a copy whose holdings are not known (recovered from
    /// disk, or left on a failed disk).
    pub fn unknown() -> Self {
        Self {
            highest: BTreeMap::new(),
            clock: 0,
            complete: false,
        }
    }

    /// Whether it lists every publish the copy holds.
    pub fn is_complete(&self) -> bool {
        self.complete
    }

    /// How many publishers it names.
    pub fn publishers(&self) -> usize {
        self.highest.len()
    }

    /// Whether the copy holds publish `id`.
    pub fn holds(&self, id: PublishId) -> Holds {
        match self.highest.get(&id.publisher) {
            Some((s, _)) if *s >= id.seq => Holds::Yes,
            Some(_) => Holds::No,
            None if self.complete => Holds::No,
            None => Holds::Unknown,
        }
    }

    /// Notes that the copy took publish `id`.
    pub fn note(&mut self, id: PublishId) {
        self.clock += 1;
        let e = self.highest.entry(id.publisher).or_insert((0, 0));
        *e = (e.0.max(id.seq), self.clock);
        if self.highest.len() > HELD_PUBLISHERS_MAX {
            self.forget_least_recent();
        }
    }

    /// Forgets the half of its publishers heard from least recently.
    fn forget_least_recent(&mut self) {
        let mut stamps: Vec<u64> = self.highest.values().map(|(_, t)| *t).collect();
        let keep = HELD_PUBLISHERS_MAX / 2;
        let cut = stamps.len() - keep;
        let (_, oldest_kept, _) = stamps.select_nth_unstable(cut);
        let oldest_kept = *oldest_kept;
        self.highest.retain(|_, (_, t)| *t >= oldest_kept);
        self.complete = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(publisher: u64, seq: u64) -> PublishId {
        PublishId { publisher, seq }
    }

    #[test]
    fn a_new_copy_holds_up_to_what_it_noted() {
        let mut h = HeldPublishes::new();
        assert_eq!(h.holds(id(1, 1)), Holds::No);
        h.note(id(1, 3));
        h.note(id(1, 2));
        assert_eq!(h.holds(id(1, 1)), Holds::Yes);
        assert_eq!(h.holds(id(1, 3)), Holds::Yes);
        assert_eq!(h.holds(id(1, 4)), Holds::No);
        assert_eq!(h.holds(id(2, 1)), Holds::No);
        assert_eq!(h.publishers(), 1);
    }

    #[test]
    fn a_recovered_copy_knows_only_publishers_heard_since() {
        let mut h = HeldPublishes::unknown();
        assert_eq!(h.holds(id(1, 1)), Holds::Unknown);
        h.note(id(1, 5));
        assert_eq!(h.holds(id(1, 5)), Holds::Yes);
        assert_eq!(h.holds(id(1, 6)), Holds::No);
        assert_eq!(h.holds(id(2, 1)), Holds::Unknown);
        assert!(!h.is_complete());
    }

    /// Past its bound it forgets the publishers heard from least recently,
    /// and then cannot tell about them: a publish of theirs sent again is
    /// refused rather than taken twice.
    #[test]
    fn it_forgets_the_publishers_heard_from_least_recently() {
        let mut h = HeldPublishes::new();
        for p in 0..HELD_PUBLISHERS_MAX as u64 {
            h.note(id(p, 1));
        }
        h.note(id(0, 2));
        assert!(h.is_complete());
        h.note(id(HELD_PUBLISHERS_MAX as u64, 1));
        assert!(!h.is_complete());
        assert_eq!(h.publishers(), HELD_PUBLISHERS_MAX / 2);
        assert_eq!(h.holds(id(0, 2)), Holds::Yes, "heard from lately");
        assert_eq!(h.holds(id(HELD_PUBLISHERS_MAX as u64, 1)), Holds::Yes);
        assert_eq!(h.holds(id(1, 1)), Holds::Unknown, "forgotten");
        let last_kept = HELD_PUBLISHERS_MAX as u64 - 1;
        assert_eq!(h.holds(id(last_kept, 1)), Holds::Yes);
    }
}

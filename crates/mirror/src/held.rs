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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldPublishes {
    highest: BTreeMap<u64, u64>,
    complete: bool,
}

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
            complete: true,
        }
    }

    /// The record of a copy whose holdings are not known (recovered from
    /// disk, or left on a failed disk).
    pub fn unknown() -> Self {
        Self {
            highest: BTreeMap::new(),
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
            Some(s) if *s >= id.seq => Holds::Yes,
            Some(_) => Holds::No,
            None if self.complete => Holds::No,
            None => Holds::Unknown,
        }
    }

    /// Notes that the copy took publish `id`.
    pub fn note(&mut self, id: PublishId) {
        let e = self.highest.entry(id.publisher).or_insert(0);
        *e = (*e).max(id.seq);
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
}

//! What publishes a copy of a queue holds: the record by which a master
//! (or a queue served alone from its local store) takes a publish sent
//! again only once, and never confirms one it refused.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::wire::PublishId;

/// The highest sequence number held per publisher, the publishes refused
/// below it, and whether that lists every publish the copy holds. A
/// publisher's publishes reach a copy in order, so holding `(p, s)` means
/// holding every earlier publish of `p` that reached it, but those it
/// refused (`x-overflow: reject-publish`, a master cut off from the
/// majority): a refusal's nack may be lost with a link, and the publish sent
/// again after a later one was held.
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
/// Likewise it keeps at most [`REFUSED_RUNS_MAX`] runs of refusals per
/// publisher, and cannot tell about the publishes below those it forgot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldPublishes {
    publishers: BTreeMap<u64, Publisher>,
    /// Counts the notes, to tell the publishers heard from least recently.
    clock: u64,
    complete: bool,
}

/// What a [`HeldPublishes`] knows of one publisher.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Publisher {
    /// The highest seq held (0: none).
    highest: u64,
    /// When it was last noted (`HeldPublishes::clock`).
    stamp: u64,
    /// Runs of refused seqs, oldest first: every publish of the publisher
    /// whose seq is in `[from, to]` was refused.
    refused: Vec<(u64, u64)>,
    /// Seqs up to this one may have been refused in runs forgotten.
    unknown_upto: u64,
}

/// The publishers a [`HeldPublishes`] names at most; it forgets half of
/// them at once, those heard from least recently.
pub const HELD_PUBLISHERS_MAX: usize = 2048;

/// The runs of refused publishes a [`HeldPublishes`] keeps per publisher.
pub const REFUSED_RUNS_MAX: usize = 32;

/// Whether a copy holds a publish ([`HeldPublishes::holds`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holds {
    /// It holds it.
    Yes,
    /// It does not.
    No,
    /// It cannot tell: its record is not complete and names nothing of the
    /// publisher, or the publish is among refusals it forgot.
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
            publishers: BTreeMap::new(),
            clock: 0,
            complete: true,
        }
    }

    /// The record of a copy whose holdings are not known (recovered from
    /// disk, or left on a failed disk).
    pub fn unknown() -> Self {
        Self {
            publishers: BTreeMap::new(),
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
        self.publishers.len()
    }

    /// Whether the copy holds publish `id`.
    pub fn holds(&self, id: PublishId) -> Holds {
        let Some(p) = self.publishers.get(&id.publisher) else {
            return if self.complete {
                Holds::No
            } else {
                Holds::Unknown
            };
        };
        if p.refused.iter().any(|&(a, b)| (a..=b).contains(&id.seq)) {
            Holds::No
        } else if id.seq <= p.unknown_upto {
            Holds::Unknown
        } else if id.seq <= p.highest {
            Holds::Yes
        } else {
            Holds::No
        }
    }

    /// Notes that the copy took publish `id`.
    pub fn note(&mut self, id: PublishId) {
        self.clock += 1;
        let clock = self.clock;
        let p = self.publishers.entry(id.publisher).or_default();
        p.highest = p.highest.max(id.seq);
        p.stamp = clock;
        // Taken now (sent again after its refusal): no longer refused.
        if let Some(i) = p
            .refused
            .iter()
            .position(|&(a, b)| (a..=b).contains(&id.seq))
        {
            let (a, b) = p.refused.remove(i);
            let split = [(a, id.seq - 1), (id.seq + 1, b)];
            for (k, run) in split.into_iter().filter(|(a, b)| a <= b).enumerate() {
                p.refused.insert(i + k, run);
            }
            p.forget_oldest_runs();
        }
        if self.publishers.len() > HELD_PUBLISHERS_MAX {
            self.forget_least_recent();
        }
    }

    /// Notes that the copy refused publish `id` (took no copy of it).
    /// Nothing for a publish it holds (refused when it came again), nor of
    /// a publisher an incomplete record does not name: it stays unknown.
    pub fn refuse(&mut self, id: PublishId) {
        if self.holds(id) != Holds::No {
            return;
        }
        self.clock += 1;
        let clock = self.clock;
        let p = self.publishers.entry(id.publisher).or_default();
        p.stamp = clock;
        match p.refused.last_mut() {
            // Nothing held since the last run began: the run goes on.
            Some((a, b)) if p.highest < *a && id.seq > *b => *b = id.seq,
            _ => p.refused.push((id.seq, id.seq)),
        }
        p.forget_oldest_runs();
        if self.publishers.len() > HELD_PUBLISHERS_MAX {
            self.forget_least_recent();
        }
    }

    /// Forgets the half of its publishers heard from least recently.
    fn forget_least_recent(&mut self) {
        let mut stamps: Vec<u64> = self.publishers.values().map(|p| p.stamp).collect();
        let keep = HELD_PUBLISHERS_MAX / 2;
        let cut = stamps.len() - keep;
        let (_, oldest_kept, _) = stamps.select_nth_unstable(cut);
        let oldest_kept = *oldest_kept;
        self.publishers.retain(|_, p| p.stamp >= oldest_kept);
        self.complete = false;
    }
}

impl Publisher {
    /// Keeps the newest [`REFUSED_RUNS_MAX`] runs; what the others covered
    /// is no longer known.
    fn forget_oldest_runs(&mut self) {
        while self.refused.len() > REFUSED_RUNS_MAX {
            let (_, b) = self.refused.remove(0);
            self.unknown_upto = self.unknown_upto.max(b);
        }
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
        h.refuse(id(1, 1));
        assert_eq!(h.holds(id(1, 1)), Holds::Unknown, "not heard: refused");
        h.note(id(1, 5));
        assert_eq!(h.holds(id(1, 5)), Holds::Yes);
        assert_eq!(h.holds(id(1, 6)), Holds::No);
        assert_eq!(h.holds(id(2, 1)), Holds::Unknown);
        assert!(!h.is_complete());
    }

    /// A refused publish is not held though a later one is; taken when sent
    /// again, it is.
    #[test]
    fn a_refused_publish_is_not_held_below_a_later_one() {
        let mut h = HeldPublishes::new();
        h.note(id(1, 1));
        h.refuse(id(1, 2));
        h.refuse(id(1, 4));
        h.note(id(1, 5));
        h.refuse(id(1, 7));
        assert_eq!(h.holds(id(1, 1)), Holds::Yes);
        assert_eq!(h.holds(id(1, 2)), Holds::No);
        assert_eq!(h.holds(id(1, 3)), Holds::No, "in the run 2..=4");
        assert_eq!(h.holds(id(1, 4)), Holds::No);
        assert_eq!(h.holds(id(1, 5)), Holds::Yes);
        assert_eq!(h.holds(id(1, 7)), Holds::No);
        h.note(id(1, 2));
        assert_eq!(h.holds(id(1, 2)), Holds::Yes, "sent again and taken");
        assert_eq!(h.holds(id(1, 4)), Holds::No);
        let mut fresh = HeldPublishes::new();
        fresh.refuse(id(9, 3));
        assert_eq!(fresh.holds(id(9, 3)), Holds::No);
        assert_eq!(fresh.holds(id(9, 2)), Holds::No);
    }

    /// Past [`REFUSED_RUNS_MAX`] runs, what the oldest covered is unknown:
    /// a publish sent again there is refused, neither confirmed nor taken.
    #[test]
    fn refusals_past_its_bound_leave_the_oldest_unknown() {
        let mut h = HeldPublishes::new();
        for k in 0..=REFUSED_RUNS_MAX as u64 {
            h.note(id(1, 2 * k + 1));
            h.refuse(id(1, 2 * k + 2));
        }
        assert_eq!(h.holds(id(1, 1)), Holds::Unknown);
        assert_eq!(h.holds(id(1, 2)), Holds::Unknown);
        assert_eq!(h.holds(id(1, 3)), Holds::Yes);
        assert_eq!(h.holds(id(1, 4)), Holds::No);
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

//! Ring views: who is in the ring, in which order, at which version.
//!
//! A [`View`] is gm.erl's `gm_group` record: an ordered list of entries (the
//! ring order) and a version that grows by one at every change. Dead members
//! stay in the list as *aliases* until their last messages have drained; each
//! dead entry is owned (inherited) by the next alive entry after it, wrapping
//! round. Views only ever change through [`View::apply`], driven by a
//! [`ViewAuthority`](crate::ViewAuthority) that orders all changes totally.

use std::fmt;

use serde::{Deserialize, Serialize};
use warren_wire::NodeName;

/// A view's version. It only grows; the empty view of a new ring is version 0.
pub type ViewVersion = u64;

/// The identity of one ring member: unique for the lifetime of a ring.
///
/// A member that restarts joins again under a new id (an incarnation).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct MemberId(pub u64);

impl fmt::Debug for MemberId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "m{}", self.0)
    }
}

impl fmt::Display for MemberId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "m{}", self.0)
    }
}

/// One entry of a view's ring list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ViewEntry {
    /// The member.
    pub id: MemberId,
    /// False once the member is dead or has left (it is then an alias of its owner).
    pub alive: bool,
    /// The version of the view that spliced the member in: it delivers every
    /// message broadcast in a view of this version or later, and none before.
    pub joined_at: ViewVersion,
    /// The alive member it was spliced in after, which hands it its state;
    /// `None` for a member that started the ring afresh (with nothing in flight).
    pub sponsor: Option<MemberId>,
    /// The node the member runs on (where its frames go).
    pub node: NodeName,
}

/// A ring view: the ordered ring (with dead aliases) and its version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct View {
    /// The version; grows by one at every change.
    pub version: ViewVersion,
    /// The ring in order: each entry's right neighbour is the next alive entry.
    pub entries: Vec<ViewEntry>,
}

/// A change to a view, proposed to the [`ViewAuthority`](crate::ViewAuthority).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ViewChange {
    /// Splice `member` in directly to the right of the alive member `after`
    /// (which hands it the messages in flight). `after: None` starts the ring
    /// afresh and is allowed only when no member is alive.
    Join {
        /// The joiner (a fresh id).
        member: MemberId,
        /// Its left neighbour.
        after: Option<MemberId>,
        /// The node the joiner runs on.
        node: NodeName,
    },
    /// `member` died or left: it becomes an alias of the next alive member.
    Remove(MemberId),
    /// The dead `member` has nothing left in flight: drop its alias.
    Erase(MemberId),
}

/// Why a [`ViewChange`] cannot be applied to a view.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ViewError {
    /// The member is already in the view (alive or as an alias).
    #[error("{0} is already in the view")]
    AlreadyMember(MemberId),
    /// The member named as the joiner's left neighbour is not alive in the view.
    #[error("{0} is not an alive member of the view")]
    NotAlive(MemberId),
    /// `Join { after: None }` while some member is alive.
    #[error("the ring has alive members: a joiner must name its left neighbour")]
    RingNotEmpty,
    /// The member to erase is not a dead entry of the view.
    #[error("{0} is not a dead entry of the view")]
    NotDead(MemberId),
    /// A compare-and-set lost: the view is no longer at the expected version.
    #[error("view conflict: expected version {expected}, current is {current}")]
    Conflict {
        /// The version the proposer based its change on.
        expected: ViewVersion,
        /// The authority's current version.
        current: ViewVersion,
    },
    /// The authority could not decide the change now (no majority, no
    /// leader, a failing store); it may still be applied. Try again later.
    #[error("view change not decided: {0}")]
    Unavailable(String),
}

impl View {
    /// The empty view (version 0) every ring starts from.
    pub fn empty() -> Self {
        Self {
            version: 0,
            entries: Vec::new(),
        }
    }

    fn position(&self, id: MemberId) -> Option<usize> {
        self.entries.iter().position(|e| e.id == id)
    }

    /// The entry of `id`, alive or dead.
    pub fn entry(&self, id: MemberId) -> Option<&ViewEntry> {
        self.entries.iter().find(|e| e.id == id)
    }

    /// Whether `id` is an alive member.
    pub fn is_alive(&self, id: MemberId) -> bool {
        self.entry(id).is_some_and(|e| e.alive)
    }

    /// The alive members in ring order.
    pub fn alive(&self) -> impl Iterator<Item = MemberId> + '_ {
        self.entries.iter().filter(|e| e.alive).map(|e| e.id)
    }

    /// The next alive member after `id`'s position, wrapping round (may be `id` itself).
    pub fn right_of(&self, id: MemberId) -> Option<MemberId> {
        let pos = self.position(id)?;
        let n = self.entries.len();
        (1..=n)
            .map(|k| &self.entries[(pos + k) % n])
            .find(|e| e.alive)
            .map(|e| e.id)
    }

    /// The previous alive member before `id`'s position, wrapping round (may be `id` itself).
    pub fn left_of(&self, id: MemberId) -> Option<MemberId> {
        let pos = self.position(id)?;
        let n = self.entries.len();
        (1..=n)
            .map(|k| &self.entries[(pos + n - k) % n])
            .find(|e| e.alive)
            .map(|e| e.id)
    }

    /// Who carries `id`'s messages: `id` itself if alive, else the next alive member after it.
    pub fn owner_of(&self, id: MemberId) -> Option<MemberId> {
        match self.entry(id) {
            Some(e) if e.alive => Some(id),
            Some(_) => self.right_of(id),
            None => None,
        }
    }

    /// The dead entries that `owner` inherits (those whose next alive entry is `owner`).
    pub fn inherited_by(&self, owner: MemberId) -> Vec<MemberId> {
        let Some(pos) = self.position(owner) else {
            return Vec::new();
        };
        let n = self.entries.len();
        (1..n)
            .map(|k| &self.entries[(pos + n - k) % n])
            .take_while(|e| !e.alive)
            .map(|e| e.id)
            .collect()
    }

    /// The view after `change`, at the next version.
    pub fn apply(&self, change: &ViewChange) -> Result<Self, ViewError> {
        let mut next = self.clone();
        next.version = self.version + 1;
        match *change {
            ViewChange::Join {
                member,
                after,
                ref node,
            } => {
                if self.entry(member).is_some() {
                    return Err(ViewError::AlreadyMember(member));
                }
                let entry = ViewEntry {
                    id: member,
                    alive: true,
                    joined_at: next.version,
                    sponsor: after,
                    node: node.clone(),
                };
                match after {
                    None if self.alive().next().is_some() => return Err(ViewError::RingNotEmpty),
                    // Nobody alive: the dead have nobody to hand their messages to.
                    None => next.entries = vec![entry],
                    Some(left) => {
                        let pos = self
                            .position(left)
                            .filter(|&p| self.entries[p].alive)
                            .ok_or(ViewError::NotAlive(left))?;
                        next.entries.insert(pos + 1, entry);
                    }
                }
            }
            ViewChange::Remove(member) => {
                let pos = self
                    .position(member)
                    .filter(|&p| self.entries[p].alive)
                    .ok_or(ViewError::NotAlive(member))?;
                next.entries[pos].alive = false;
            }
            ViewChange::Erase(member) => {
                let pos = self
                    .position(member)
                    .filter(|&p| !self.entries[p].alive)
                    .ok_or(ViewError::NotDead(member))?;
                next.entries.remove(pos);
            }
        }
        Ok(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(n: u64) -> MemberId {
        MemberId(n)
    }

    fn node() -> NodeName {
        NodeName::new("n@test").unwrap()
    }

    fn ring(ids: &[u64]) -> View {
        let mut v = View::empty();
        let mut prev = None;
        for &id in ids {
            v = v
                .apply(&ViewChange::Join {
                    member: m(id),
                    after: prev,
                    node: node(),
                })
                .unwrap();
            prev = Some(m(id));
        }
        v
    }

    #[test]
    fn joins_splice_right_of_their_left() {
        let v = ring(&[1, 2, 3]);
        assert_eq!(v.version, 3);
        assert_eq!(v.alive().collect::<Vec<_>>(), vec![m(1), m(2), m(3)]);
        let v = v
            .apply(&ViewChange::Join {
                member: m(4),
                after: Some(m(1)),
                node: node(),
            })
            .unwrap();
        assert_eq!(v.alive().collect::<Vec<_>>(), vec![m(1), m(4), m(2), m(3)]);
        assert_eq!(v.entry(m(4)).unwrap().joined_at, 4);
        assert_eq!(v.right_of(m(3)), Some(m(1)));
        assert_eq!(v.left_of(m(1)), Some(m(3)));
    }

    #[test]
    fn dead_members_are_aliases_of_the_next_alive() {
        let v = ring(&[1, 2, 3, 4]);
        let v = v.apply(&ViewChange::Remove(m(2))).unwrap();
        let v = v.apply(&ViewChange::Remove(m(3))).unwrap();
        assert_eq!(v.owner_of(m(2)), Some(m(4)));
        assert_eq!(v.owner_of(m(3)), Some(m(4)));
        assert_eq!(v.inherited_by(m(4)), vec![m(3), m(2)]);
        assert_eq!(v.right_of(m(1)), Some(m(4)));
        // A joiner right of 1 goes before the aliases: ownership does not move.
        let v = v
            .apply(&ViewChange::Join {
                member: m(5),
                after: Some(m(1)),
                node: node(),
            })
            .unwrap();
        assert_eq!(v.owner_of(m(2)), Some(m(4)));
        assert!(v.inherited_by(m(5)).is_empty());
        let v = v.apply(&ViewChange::Erase(m(2))).unwrap();
        assert!(v.entry(m(2)).is_none());
    }

    #[test]
    fn bad_changes_are_refused() {
        let v = ring(&[1, 2]);
        let join = |member, after| ViewChange::Join {
            member,
            after,
            node: node(),
        };
        assert_eq!(
            v.apply(&join(m(1), Some(m(2)))),
            Err(ViewError::AlreadyMember(m(1)))
        );
        assert_eq!(
            v.apply(&join(m(3), Some(m(9)))),
            Err(ViewError::NotAlive(m(9)))
        );
        assert_eq!(v.apply(&join(m(3), None)), Err(ViewError::RingNotEmpty));
        assert_eq!(
            v.apply(&ViewChange::Erase(m(1))),
            Err(ViewError::NotDead(m(1)))
        );
        let v = v.apply(&ViewChange::Remove(m(1))).unwrap();
        let v = v.apply(&ViewChange::Remove(m(2))).unwrap();
        // Everyone dead: a fresh start drops the aliases.
        let v = v.apply(&join(m(3), None)).unwrap();
        assert_eq!(v.entries.len(), 1);
    }
}

//! The election a voter calls at once when the Raft leader's process is
//! gone, instead of after the election timeout: [`stand_against_a_dead_leader`]
//! decides whether to stand and runs the rounds; [`Rounds`] is what each
//! round decides, pure so that each rule is tested on its own.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use warren_transport::PeerAddr;
use warren_wire::NodeName;

use super::Inner;
use crate::types::NodeId;

/// How long at least a voter that sees the Raft leader's process gone keeps
/// calling elections, a short pause apart, until a new leader follows (and
/// for the election timeout's upper bound, the leader lease, if longer). It covers
/// the other voters' detection (over QUIC, a probe every 50 ms after 50 ms
/// of silence): with 5 calls in about 120 ms, the others, still refusing with
/// their leases, once left the cluster leaderless until the election
/// timeout (a 1.3 s publisher stall in `bench mirrored`).
const ELECTION_RETRY_WINDOW: Duration = Duration::from_millis(600);

/// How many rounds in a row (20–60 ms each) a voter that stood against a
/// dead leader sees the same new leader before it stops watching.
const LEADER_HELD_ROUNDS: u32 = 5;

/// What a voter does after one round of the election against a dead leader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Stand: call an election now, then go on to the next round.
    Stand,
    /// Ask again in the next round, without standing.
    Again,
    /// A new leader has held: the election is over.
    Done,
}

/// The rounds of one election against dead leader `gone`. Each round asks
/// the other voters to answer at once, waits a pause, and stands only if a
/// majority of the voters, this node included and the dead leader left
/// out, answered that round's ask and would grant a vote: a pre-vote per
/// election.
/// - Only answers to this round's ask count: frames merely received since
///   could have been sent before a cut. A node isolated by a firewall's
///   resets (refused by every other) took them for a majority, stood, and
///   deposed the leader on the heal (`cargo xtask chaos --seed 67 --nodes 5`).
/// - The rounds go on until one leader has held for [`LEADER_HELD_ROUNDS`]:
///   a survivor whose election crossed its rival's win deposed it, then
///   stood again and again with a log shorter than the deposed leader's,
///   which had stopped standing (`t27`, once in 30 runs beside busy loops).
#[derive(Debug)]
struct Rounds {
    /// The dead leader.
    gone: NodeId,
    /// How many voters the cluster has.
    voters: usize,
    /// The leader seen in the last rounds, and for how many in a row.
    last: Option<NodeId>,
    held: u32,
}

impl Rounds {
    fn new(gone: NodeId, voters: usize) -> Self {
        Self {
            gone,
            voters,
            last: None,
            held: 0,
        }
    }

    /// After a round's pause: `leader` is the leader Raft knows now,
    /// `willing` how many voters, this one included, answered this round's
    /// ask and would vote.
    fn after_round(&mut self, leader: Option<NodeId>, willing: usize) -> Step {
        // A new leader: standing now would only depose it. It may still be
        // deposed by another survivor's election that crossed its win (its
        // log then longer than that survivor's, which cannot win), so this
        // watches on until one leader has held a while.
        if let Some(l) = leader.filter(|l| *l != self.gone) {
            self.held = if self.last == Some(l) {
                self.held + 1
            } else {
                1
            };
            self.last = Some(l);
            return if self.held >= LEADER_HELD_ROUNDS {
                Step::Done
            } else {
                Step::Again
            };
        }
        self.held = 0;
        if willing * 2 > self.voters {
            Step::Stand
        } else {
            Step::Again
        }
    }
}

/// Calls elections at once, instead of after the election timeout, when the
/// Raft leader (`leader`, as last known) is down and its address refuses:
/// its process is gone. Checked on every pass of the failure detector, not
/// only when the leader goes down: a voter that counted the leader down by
/// its silence before its address refused (the others standing and this
/// one's lease refusing their votes) stands too once it refuses.
///
/// Every surviving voter calls an election: each one's own candidacy lifts
/// its leader lease (a lone candidate would be refused by the others'
/// leases until they expire). Same-term candidacies can split the votes,
/// so a voter still without a leader tries again after a short pause,
/// different on each voter (from its random node id), rather than after
/// the election timeout ([`Rounds`]). `stood` remembers the leader stood
/// against, so that each death is answered once.
pub(super) fn stand_against_a_dead_leader(
    inner: &Arc<Inner>,
    members: &[(NodeId, NodeName, PeerAddr)],
    up: &BTreeSet<NodeName>,
    voters: &BTreeSet<NodeId>,
    leader: Option<NodeId>,
    stood: &mut Option<NodeId>,
) {
    let gone = leader.and_then(|l| members.iter().find(|(id, _, _)| *id == l));
    let Some((gone_id, gone_name, _)) = gone else {
        *stood = None;
        return;
    };
    if up.contains(gone_name) || !inner.peers.refused(gone_name) {
        *stood = None;
        return;
    }
    if *stood == Some(*gone_id) || !voters.contains(&inner.id) {
        return;
    }
    *stood = Some(*gone_id);
    tracing::info!(node = %inner.config.node, leader = %gone_name, "the Raft leader is gone: calling an election now");
    let raft = inner.raft.clone();
    let pause = Duration::from_millis(20 + inner.id % 40);
    // At least until the other voters' leases have run out: a voter that
    // has not seen the leader go refuses a vote until then.
    let until = Instant::now() + ELECTION_RETRY_WINDOW.max(inner.config.election_timeout_max);
    let others: Vec<(NodeName, PeerAddr)> = members
        .iter()
        .filter(|(_, name, _)| name != gone_name)
        .map(|(_, name, addr)| (name.clone(), addr.clone()))
        .collect();
    // The voters whose answers count: every one but this node and the
    // leader.
    let counted: Vec<NodeName> = members
        .iter()
        .filter(|(id, name, _)| voters.contains(id) && name != gone_name)
        .map(|(_, name, _)| name.clone())
        .collect();
    let mut rounds = Rounds::new(*gone_id, voters.len());
    let weak = Arc::downgrade(inner);
    tokio::spawn(async move {
        while Instant::now() < until {
            let Some(i) = weak.upgrade() else { break };
            // Each round asks the others to answer at once, so that a live
            // majority answers within a round trip, not the heartbeat pace.
            let ask = i.peers.new_ask();
            for (name, addr) in &others {
                let (peers, name, addr) = (i.peers.clone(), name.clone(), addr.clone());
                let bound = i.config.failure_timeout;
                tokio::spawn(async move {
                    let _ = peers.heartbeat(&name, &addr, bound, ask).await;
                });
            }
            drop(i);
            tokio::time::sleep(pause).await;
            let Some(i) = weak.upgrade() else { break };
            let willing = 1 + counted
                .iter()
                .filter(|n| i.peers.would_vote_since(n, ask))
                .count();
            drop(i);
            let leader = raft.metrics().borrow().current_leader;
            match rounds.after_round(leader, willing) {
                Step::Stand => {
                    let _ = raft.trigger().elect().await;
                }
                Step::Again => {}
                Step::Done => break,
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    const GONE: NodeId = 9;

    #[test]
    fn a_majority_willing_without_a_leader_stands() {
        let mut r = Rounds::new(GONE, 3);
        assert_eq!(r.after_round(None, 2), Step::Stand);
        // The dead leader, still named by Raft, is no leader.
        assert_eq!(r.after_round(Some(GONE), 2), Step::Stand);
    }

    #[test]
    fn a_minority_willing_asks_again_without_standing() {
        let mut r = Rounds::new(GONE, 5);
        assert_eq!(r.after_round(None, 2), Step::Again);
        assert_eq!(r.after_round(None, 1), Step::Again);
        assert_eq!(r.after_round(None, 3), Step::Stand);
    }

    #[test]
    fn a_new_leader_is_watched_until_it_has_held() {
        let mut r = Rounds::new(GONE, 3);
        for _ in 1..LEADER_HELD_ROUNDS {
            // Willing or not, a live leader is not stood against.
            assert_eq!(r.after_round(Some(1), 3), Step::Again);
        }
        assert_eq!(r.after_round(Some(1), 3), Step::Done);
    }

    #[test]
    fn a_leader_deposed_or_replaced_starts_the_count_again() {
        let mut r = Rounds::new(GONE, 3);
        for _ in 1..LEADER_HELD_ROUNDS {
            assert_eq!(r.after_round(Some(1), 3), Step::Again);
        }
        // Another survivor's election deposed it: stand again.
        assert_eq!(r.after_round(None, 2), Step::Stand);
        // A different leader counts from one.
        for _ in 1..LEADER_HELD_ROUNDS {
            assert_eq!(r.after_round(Some(2), 3), Step::Again);
        }
        assert_eq!(r.after_round(Some(2), 3), Step::Done);
        let mut r = Rounds::new(GONE, 3);
        assert_eq!(r.after_round(Some(1), 3), Step::Again);
        assert_eq!(r.after_round(Some(2), 3), Step::Again);
        for _ in 2..LEADER_HELD_ROUNDS {
            assert_eq!(r.after_round(Some(2), 3), Step::Again);
        }
        assert_eq!(r.after_round(Some(2), 3), Step::Done);
    }
}

//! Failure detection between nodes: who is suspected dead.
//!
//! Ring members never heartbeat each other; nodes do, once per pair of nodes
//! whatever the number of rings they share. The driver reports a suspected
//! node's members that neighbour its own members to the view authority.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use tokio::time::Instant;
use warren_wire::NodeName;

/// A pluggable failure detector, driven by the [`driver`](crate::driver) (sans-IO: time is passed in).
///
/// Contract: `heartbeat_due` is true at the first call and then whenever
/// the detector's heartbeat interval has passed since it was last true. A
/// peer is suspected only once watched, only while no sign of life comes
/// from it (whatever the detector counts as one), at most once until it is
/// alive again, and surely within the detector's timeout of its last sign
/// of life. The suite `conformance::failure_detector` (feature
/// `conformance`) checks this.
pub trait FailureDetector: Send + fmt::Debug + 'static {
    /// Start watching `peer` (a node this node shares a ring with).
    fn watch(&mut self, peer: &NodeName, now: Instant);
    /// Anything (a heartbeat or any other frame) arrived from `peer`.
    fn heard_from(&mut self, peer: &NodeName, now: Instant);
    /// Whether this node should send its heartbeats now.
    fn heartbeat_due(&mut self, now: Instant) -> bool;
    /// Peers suspected dead since the last call.
    fn poll_suspects(&mut self, now: Instant) -> Vec<NodeName>;
}

/// Per node pair heartbeats: a peer silent for longer than `timeout` is suspected.
#[derive(Debug)]
pub struct HeartbeatDetector {
    interval: Duration,
    timeout: Duration,
    last_sent: Option<Instant>,
    last_heard: BTreeMap<NodeName, Instant>,
    suspected: BTreeSet<NodeName>,
}

impl HeartbeatDetector {
    /// Heartbeats every `interval`; suspicion after `timeout` of silence.
    pub fn new(interval: Duration, timeout: Duration) -> Self {
        Self {
            interval,
            timeout,
            last_sent: None,
            last_heard: BTreeMap::new(),
            suspected: BTreeSet::new(),
        }
    }
}

impl FailureDetector for HeartbeatDetector {
    fn watch(&mut self, peer: &NodeName, now: Instant) {
        self.last_heard.entry(peer.clone()).or_insert(now);
    }

    fn heard_from(&mut self, peer: &NodeName, now: Instant) {
        self.last_heard.insert(peer.clone(), now);
        self.suspected.remove(peer);
    }

    fn heartbeat_due(&mut self, now: Instant) -> bool {
        let due = self
            .last_sent
            .is_none_or(|t| now.saturating_duration_since(t) >= self.interval);
        if due {
            self.last_sent = Some(now);
        }
        due
    }

    fn poll_suspects(&mut self, now: Instant) -> Vec<NodeName> {
        let mut out = Vec::new();
        for (peer, &heard) in &self.last_heard {
            if now.saturating_duration_since(heard) > self.timeout
                && self.suspected.insert(peer.clone())
            {
                out.push(peer.clone());
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silence_beyond_the_timeout_is_suspected_once() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let peer = NodeName::new("b@test").unwrap();
        let mut d = HeartbeatDetector::new(ms(10), ms(50));
        assert!(d.heartbeat_due(t0));
        assert!(!d.heartbeat_due(t0 + ms(5)));
        assert!(d.heartbeat_due(t0 + ms(10)));
        d.watch(&peer, t0);
        d.heard_from(&peer, t0 + ms(20));
        assert!(d.poll_suspects(t0 + ms(60)).is_empty());
        assert_eq!(d.poll_suspects(t0 + ms(71)), vec![peer.clone()]);
        assert!(d.poll_suspects(t0 + ms(90)).is_empty());
        d.heard_from(&peer, t0 + ms(100));
        assert!(d.poll_suspects(t0 + ms(120)).is_empty());
    }
}

//! The queue rings' failure detector, fed by the cluster's view of which
//! nodes are up.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use warren_gm::FailureDetector;
use warren_transport::NodeName;

/// The queue rings' failure detector: suspicions come from the cluster's
/// node-level detector (its heartbeats, and a refused connection seen at
/// once), shared by every ring of this node. The GM connections still carry
/// a heartbeat per node pair (not per ring) so that a node heard again
/// after a partition cancels the ring changes its suspicion had started.
#[derive(Debug)]
pub struct ClusterDetector {
    /// The nodes the cluster sees up.
    up: watch::Receiver<BTreeSet<NodeName>>,
    /// How many times the cluster saw each node go down.
    downs: watch::Receiver<BTreeMap<NodeName, u64>>,
    /// The peers the rings talk to, since when.
    watched: BTreeMap<NodeName, Instant>,
    /// Peers the cluster has reported up at least once.
    seen_up: BTreeSet<NodeName>,
    /// Peers reported to the rings as suspects (until the cluster sees them
    /// up), with their count in `downs` then.
    suspected: BTreeMap<NodeName, u64>,
    /// When this node last sent GM heartbeats.
    last_heartbeat: Option<Instant>,
}

impl ClusterDetector {
    /// A peer the cluster never saw up is suspected only after this long (a
    /// node that just joined is not suspected before its first heartbeat).
    pub const GRACE: Duration = Duration::from_secs(10);
    /// How often GM heartbeats go to each peer node.
    pub const HEARTBEAT: Duration = Duration::from_millis(500);

    /// A detector following `up`, the nodes the cluster sees up, and
    /// `downs`, how many times it saw each go down.
    pub fn new(
        up: watch::Receiver<BTreeSet<NodeName>>,
        downs: watch::Receiver<BTreeMap<NodeName, u64>>,
    ) -> Self {
        Self {
            up,
            downs,
            watched: BTreeMap::new(),
            seen_up: BTreeSet::new(),
            suspected: BTreeMap::new(),
            last_heartbeat: None,
        }
    }
}

impl FailureDetector for ClusterDetector {
    fn watch(&mut self, peer: &NodeName, now: Instant) {
        self.watched.entry(peer.clone()).or_insert(now);
    }

    fn heard_from(&mut self, _peer: &NodeName, _now: Instant) {}

    fn heartbeat_due(&mut self, now: Instant) -> bool {
        let due = self
            .last_heartbeat
            .is_none_or(|t| now.saturating_duration_since(t) >= Self::HEARTBEAT);
        if due {
            self.last_heartbeat = Some(now);
        }
        due
    }

    fn poll_suspects(&mut self, now: Instant) -> Vec<NodeName> {
        let up = self.up.borrow();
        let downs = self.downs.borrow();
        let mut out = Vec::new();
        for (peer, since) in &self.watched {
            if up.contains(peer) {
                self.seen_up.insert(peer.clone());
                self.suspected.remove(peer);
                continue;
            }
            let known =
                self.seen_up.contains(peer) || now.saturating_duration_since(*since) > Self::GRACE;
            // A suspect that came up and went down again between two polls
            // (a restart that died at once) is a new death: its new ring
            // members would otherwise stall their rings for good.
            let count = downs.get(peer).copied().unwrap_or(0);
            let new_death = self.suspected.get(peer).is_none_or(|&then| count > then);
            if known && new_death {
                self.suspected.insert(peer.clone(), count);
                out.push(peer.clone());
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(n: &str) -> NodeName {
        NodeName::new(n).unwrap()
    }

    #[test]
    fn the_cluster_detector_follows_the_clusters_up_set() {
        let (tx, rx) = watch::channel(BTreeSet::new());
        let (downs_tx, downs) = watch::channel(BTreeMap::new());
        let mut d = ClusterDetector::new(rx, downs);
        let t0 = Instant::now();
        let b = name("warren@b");
        d.watch(&b, t0);
        assert!(
            d.poll_suspects(t0 + Duration::from_secs(1)).is_empty(),
            "not suspected before the cluster ever saw it, within the grace"
        );
        tx.send_replace([b.clone()].into());
        assert!(d.poll_suspects(t0 + Duration::from_secs(2)).is_empty());
        tx.send_replace(BTreeSet::new());
        assert_eq!(
            d.poll_suspects(t0 + Duration::from_secs(3)),
            std::slice::from_ref(&b)
        );
        assert!(
            d.poll_suspects(t0 + Duration::from_secs(4)).is_empty(),
            "reported once"
        );
        tx.send_replace([b.clone()].into());
        assert!(d.poll_suspects(t0 + Duration::from_secs(5)).is_empty());
        tx.send_replace(BTreeSet::new());
        assert_eq!(
            d.poll_suspects(t0 + Duration::from_secs(6)),
            std::slice::from_ref(&b),
            "suspected again after it came back"
        );
        let c = name("warren@c");
        d.watch(&c, t0 + Duration::from_secs(6));
        assert_eq!(
            d.poll_suspects(t0 + Duration::from_secs(17)),
            [c],
            "never seen up: suspected after the grace"
        );
        // Up and down again between two polls: the cluster counted a
        // second death of b, so b is suspected again.
        assert!(d.poll_suspects(t0 + Duration::from_secs(18)).is_empty());
        downs_tx.send_replace([(b.clone(), 2)].into());
        assert_eq!(
            d.poll_suspects(t0 + Duration::from_secs(19)),
            std::slice::from_ref(&b),
            "suspected again after a flap no poll saw"
        );
        assert!(d.poll_suspects(t0 + Duration::from_secs(20)).is_empty());
        assert!(d.heartbeat_due(t0));
        assert!(!d.heartbeat_due(t0 + Duration::from_millis(100)));
        assert!(d.heartbeat_due(t0 + Duration::from_millis(600)));
    }
}

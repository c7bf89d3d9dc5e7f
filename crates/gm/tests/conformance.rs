//! The `ViewAuthority` and `FailureDetector` conformance suites on this
//! crate's implementations (`InMemoryAuthority`, `HeartbeatDetector`).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use warren_gm::conformance::{DetectorHarness, failure_detector, view_authority};
use warren_gm::{FailureDetector, HeartbeatDetector, InMemoryAuthority, NodeName};

#[tokio::test]
async fn in_memory_authority_keeps_the_view_authority_contract() {
    let authority = Arc::new(InMemoryAuthority::new());
    for seed in 0..8 {
        view_authority(authority.clone(), &format!("seed{seed}"), seed).await;
    }
}

/// A [`HeartbeatDetector`] learns a peer is alive from its frames.
struct Heartbeats;

const INTERVAL: Duration = Duration::from_millis(100);
const TIMEOUT: Duration = Duration::from_millis(500);

impl DetectorHarness for Heartbeats {
    type Detector = HeartbeatDetector;

    fn detector(&mut self) -> HeartbeatDetector {
        HeartbeatDetector::new(INTERVAL, TIMEOUT)
    }

    fn alive(&mut self, detector: &mut HeartbeatDetector, peer: &NodeName, now: Instant) {
        detector.heard_from(peer, now);
    }

    fn dead(&mut self, _peer: &NodeName) {}

    fn suspicion_after(&self) -> Duration {
        TIMEOUT + Duration::from_millis(1)
    }

    fn heartbeat_interval(&self) -> Duration {
        INTERVAL
    }
}

#[test]
fn heartbeat_detector_keeps_the_failure_detector_contract() {
    for seed in 0..32 {
        failure_detector(&mut Heartbeats, seed);
    }
}

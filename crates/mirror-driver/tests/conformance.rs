//! The contract suites on this crate's implementations: `ViewAuthority`
//! (`ClusterViewAuthority`) and `RecordStore` (`ClusterRecords`), each over
//! `MemMetadata` and over a one-node Raft `Cluster` on the in-memory
//! transport; `FailureDetector` (`ClusterDetector`).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use common::{QUEUE, name, queue_commands, transport};
use tempfile::TempDir;
use tokio::sync::watch;
use tokio::time::Instant;
use warren_cluster::{Cluster, ClusterConfig};
use warren_gm::NodeName;
use warren_gm::conformance::{DetectorHarness, failure_detector, view_authority};
use warren_mirror_driver::conformance::record_store;
use warren_mirror_driver::{ClusterDetector, ClusterRecords, ClusterViewAuthority, MemMetadata};
use warren_transport::PeerAddr;
use warren_transport::mem::MemNetwork;

/// Metadata in memory with the suite's queue declared.
fn mem_metadata() -> MemMetadata {
    let meta = MemMetadata::new(name("n1"));
    for cmd in queue_commands(32) {
        meta.apply(&cmd).expect("the queue's commands apply");
    }
    meta
}

/// A one-node Raft cluster (it elects itself) with the suite's queue declared.
async fn one_node_cluster(dir: &TempDir) -> Cluster {
    let mem = MemNetwork::new(7);
    let mut c = ClusterConfig::new(
        name("n1"),
        PeerAddr::new("n1"),
        dir.path().join("raft"),
        transport(&mem, "n1"),
    );
    c.raft_heartbeat_interval = Duration::from_millis(50);
    c.election_timeout_min = Duration::from_millis(250);
    c.election_timeout_max = Duration::from_millis(500);
    c.command_timeout = Duration::from_secs(5);
    let cluster = Cluster::start(c).await.expect("a one-node cluster");
    for cmd in queue_commands(32) {
        cluster
            .write(cmd)
            .await
            .expect("the queue's commands commit");
    }
    cluster
}

#[tokio::test]
async fn cluster_view_authority_over_mem_metadata() {
    let authority = Arc::new(ClusterViewAuthority::new(mem_metadata()));
    for seed in 0..4 {
        view_authority(authority.clone(), &format!("seed{seed}"), seed).await;
    }
}

#[tokio::test]
async fn cluster_records_over_mem_metadata() {
    let records = Arc::new(ClusterRecords::new(mem_metadata(), "/", QUEUE, 1));
    for seed in 0..4 {
        record_store(records.clone(), seed).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_view_authority_and_records_over_raft() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = one_node_cluster(&dir).await;
    let authority = Arc::new(ClusterViewAuthority::new(cluster.clone()));
    view_authority(authority, "raft", 1).await;
    let records = Arc::new(ClusterRecords::new(cluster.clone(), "/", QUEUE, 1));
    record_store(records, 1).await;
    cluster.shutdown().await;
}

/// A [`ClusterDetector`] learns a peer is alive from the cluster's up set
/// (and a death from its count of downs).
struct UpSet {
    up: watch::Sender<BTreeSet<NodeName>>,
    downs: watch::Sender<BTreeMap<NodeName, u64>>,
}

impl DetectorHarness for UpSet {
    type Detector = ClusterDetector;

    fn detector(&mut self) -> ClusterDetector {
        self.up.send_replace(BTreeSet::new());
        self.downs.send_replace(BTreeMap::new());
        ClusterDetector::new(self.up.subscribe(), self.downs.subscribe())
    }

    fn alive(&mut self, _detector: &mut ClusterDetector, peer: &NodeName, _now: Instant) {
        self.up.send_modify(|up| {
            up.insert(peer.clone());
        });
    }

    fn dead(&mut self, peer: &NodeName) {
        if self.up.borrow().contains(peer) {
            self.downs
                .send_modify(|downs| *downs.entry(peer.clone()).or_default() += 1);
        }
        self.up.send_modify(|up| {
            up.remove(peer);
        });
    }

    fn suspicion_after(&self) -> Duration {
        // A peer that died before any poll saw it up waits out the grace.
        ClusterDetector::GRACE + Duration::from_millis(1)
    }

    fn heartbeat_interval(&self) -> Duration {
        ClusterDetector::HEARTBEAT
    }
}

#[test]
fn cluster_detector_keeps_the_failure_detector_contract() {
    let mut harness = UpSet {
        up: watch::Sender::new(BTreeSet::new()),
        downs: watch::Sender::new(BTreeMap::new()),
    };
    for seed in 0..32 {
        failure_detector(&mut harness, seed);
    }
}

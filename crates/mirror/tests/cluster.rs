//! Three real nodes in one process over the in-memory transport: a Raft
//! metadata store (`warren_cluster::Cluster`) holding the queue record and the
//! ring's views, a `GmNode`, and one replica each. The master's node dies
//! (its GM node, its cluster node and its connections) under confirmed
//! publishing; the oldest synchronised mirror is promoted through Raft and no
//! confirmed message is lost.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use tempfile::TempDir;
use warren_backing_queue::{BackingQueue, NewMessage, QueueConfig};
use warren_cluster::{Cluster, ClusterConfig, Command, QueueRecord};
use warren_gm::{GmNode, HeartbeatDetector, NodeConfig, ViewAuthority};
use warren_mirror::{
    ClusterRecords, ClusterViewAuthority, Confirm, DriverConfig, MirrorEvent, MirrorHandle,
    PublishId, RecordStore, Role, Settings,
};
use warren_policy::SyncMode;
use warren_transport::mem::MemNetwork;
use warren_transport::{ClusterSecret, NodeName, PeerAddr, TransportConfig};

const RING: &str = "/:q";

struct Node {
    cluster: Cluster,
    gm: GmNode,
    _dir: TempDir,
}

fn transport(mem: &MemNetwork, name: &str) -> Arc<warren_transport::mem::MemTransport> {
    let node = NodeName::new(name).unwrap();
    Arc::new(mem.transport(TransportConfig::new(
        node,
        ClusterSecret::new("mirror-cluster"),
    )))
}

async fn start(mem: &MemNetwork, name: &str, join: Option<&str>) -> Node {
    let dir = tempfile::tempdir().unwrap();
    let mut c = ClusterConfig::new(
        NodeName::new(name).unwrap(),
        PeerAddr::new(name),
        dir.path(),
        transport(mem, name),
    );
    c.join = join.map(PeerAddr::new);
    c.raft_heartbeat_interval = Duration::from_millis(50);
    c.election_timeout_min = Duration::from_millis(250);
    c.election_timeout_max = Duration::from_millis(500);
    c.command_timeout = Duration::from_secs(2);
    c.heartbeat_interval = Duration::from_millis(100);
    c.failure_timeout = Duration::from_millis(600);
    c.boot_wait_timeout = Duration::from_secs(2);
    c.boot_wait_retries = 5;
    let cluster = Cluster::start(c).await.expect("cluster node");
    let authority: Arc<dyn ViewAuthority> = Arc::new(ClusterViewAuthority::new(cluster.clone()));
    let mut config = NodeConfig::new(
        NodeName::new(name).unwrap(),
        PeerAddr::new(format!("gm-{name}")),
    );
    config.tick_interval = Duration::from_millis(5);
    config.redial_interval = Duration::from_millis(30);
    // Generous: on a loaded 2-core machine a short timeout suspects live nodes.
    let detector = HeartbeatDetector::new(Duration::from_millis(25), Duration::from_millis(1500));
    let gm = GmNode::start(config, transport(mem, name), authority, Box::new(detector))
        .await
        .expect("GM node");
    Node {
        cluster,
        gm,
        _dir: dir,
    }
}

async fn replica(node: &Node, name: &str, master: bool) -> MirrorHandle {
    let mut cfg = DriverConfig::new("q", name, RING);
    cfg.settings = Settings {
        sync_mode: SyncMode::Automatic,
        sync_batch_size: 32,
        ..Settings::default()
    };
    cfg.tick = Duration::from_millis(5);
    let ring = node.gm.join(RING).await.unwrap();
    let authority: Arc<dyn ViewAuthority> =
        Arc::new(ClusterViewAuthority::new(node.cluster.clone()));
    let records: Arc<dyn RecordStore> =
        Arc::new(ClusterRecords::new(node.cluster.clone(), "/", "q"));
    let factory: warren_mirror::QueueFactory = Box::new(|cfg| Ok(BackingQueue::in_memory(cfg)));
    if master {
        let bq = BackingQueue::in_memory(QueueConfig {
            record_ops: true,
            ..QueueConfig::default()
        });
        MirrorHandle::start_master(cfg, ring, authority, records, factory, bq)
            .await
            .unwrap()
    } else {
        MirrorHandle::start_mirror(cfg, ring, authority, records, factory)
            .await
            .unwrap()
    }
}

async fn wait_until(what: &str, mut ok: impl AsyncFnMut() -> bool) {
    for _ in 0..3_000 {
        if ok().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("gave up waiting for: {what}");
}

async fn publish_all(h: &MirrorHandle, seqs: impl Iterator<Item = u64>) -> (Vec<u64>, Vec<u64>) {
    let mut waits = Vec::new();
    for seq in seqs {
        let msg = NewMessage::new(seq, format!("m{seq}").into_bytes(), false);
        waits.push((seq, h.publish(PublishId { publisher: 3, seq }, msg).await));
    }
    let (mut ok, mut again) = (Vec::new(), Vec::new());
    for (seq, w) in waits {
        match w {
            // (A bound against hangs, not a timing assertion.)
            Ok(rx) => match tokio::time::timeout(Duration::from_secs(60), rx).await {
                Ok(Ok(Confirm::Ack)) => ok.push(seq),
                _ => again.push(seq),
            },
            Err(_) => again.push(seq),
        }
    }
    (ok, again)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raft_backed_failover_keeps_every_confirmed_message() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
    let mem = MemNetwork::new(21);
    let mut nodes = BTreeMap::new();
    nodes.insert("n1", start(&mem, "n1", None).await);
    nodes.insert("n2", start(&mem, "n2", Some("n1")).await);
    nodes.insert("n3", start(&mem, "n3", Some("n1")).await);
    for a in ["n1", "n2", "n3"] {
        for b in ["n1", "n2", "n3"] {
            if a != b {
                let peer = &nodes[b].gm;
                nodes[a]
                    .gm
                    .add_peer(peer.node().clone(), peer.local_addr().clone())
                    .await
                    .unwrap();
            }
        }
    }
    let c1 = nodes["n1"].cluster.clone();
    c1.write(Command::PutVhost { name: "/".into() })
        .await
        .unwrap();
    c1.write(Command::DeclareQueue(QueueRecord {
        vhost: "/".into(),
        name: "q".into(),
        durable: false,
        exclusive_owner: None,
        auto_delete: false,
        arguments: Default::default(),
        master: "n1".into(),
        mirrors: vec![],
        synchronised: vec![],
        view_version: 0,
    }))
    .await
    .unwrap();
    // A mirror starts from its own node's copy of the record (as a node
    // does once the declaration reached it).
    for n in ["n2", "n3"] {
        let c = nodes[n].cluster.clone();
        wait_until("the queue record on n2 and n3", async || {
            c.local().queue("/", "q").is_some()
        })
        .await;
    }

    let m1 = replica(&nodes["n1"], "n1", true).await;
    let m2 = replica(&nodes["n2"], "n2", false).await;
    // n2 is the older mirror: it is synchronised before n3 starts.
    wait_until("n2 synchronised in the record", async || {
        c1.local()
            .queue("/", "q")
            .is_some_and(|q| q.synchronised == ["n2"])
    })
    .await;
    let m3 = replica(&nodes["n3"], "n3", false).await;
    wait_until("both mirrors synchronised in the record", async || {
        c1.local()
            .queue("/", "q")
            .is_some_and(|q| q.synchronised.len() == 2)
    })
    .await;

    let mut confirmed = BTreeSet::new();
    let (ok, again) = publish_all(&m1, 1..=100).await;
    assert!(again.is_empty());
    confirmed.extend(ok);
    // Kill n1 with a batch in flight.
    let mut ev2 = m2.events();
    let waits: Vec<_> = {
        let mut w = Vec::new();
        for seq in 101..=130 {
            let msg = NewMessage::new(seq, format!("m{seq}").into_bytes(), false);
            w.push((seq, m1.publish(PublishId { publisher: 3, seq }, msg).await));
        }
        w
    };
    let dead = nodes.remove("n1").unwrap();
    dead.gm.shutdown();
    dead.cluster.shutdown().await;
    mem.disconnect(&NodeName::new("n1").unwrap());
    m1.stop().await;
    let mut unknown = Vec::new();
    for (seq, w) in waits {
        match w.ok().map(|mut rx| rx.try_recv()) {
            Some(Ok(Confirm::Ack)) => {
                confirmed.insert(seq);
            }
            _ => unknown.push(seq),
        }
    }
    let held = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            match ev2.recv().await {
                Ok(MirrorEvent::Promoted { held, .. }) => break held,
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(e) => panic!("n2 events ended: {e}"),
            }
        }
    })
    .await
    .expect("n2, the oldest synchronised mirror, is promoted");
    // n2 is the oldest synchronised mirror.
    wait_until("n2 reports itself master", async || {
        m2.status().role == Role::Master
    })
    .await;
    let c2 = nodes["n2"].cluster.clone();
    wait_until("the record names n2 master", async || {
        c2.local().queue("/", "q").is_some_and(|q| q.master == "n2")
    })
    .await;
    let up_to = held.get(&3).copied().unwrap_or(0);
    confirmed.extend(unknown.iter().copied().filter(|s| *s <= up_to));
    let resend: Vec<u64> = unknown.into_iter().filter(|s| *s > up_to).collect();
    let (ok, again) = publish_all(&m2, resend.into_iter().chain(131..=160)).await;
    assert!(again.is_empty());
    confirmed.extend(ok);
    // Every confirmed message is on the new master, and on the surviving mirror.
    let mut seen = BTreeSet::new();
    while let Some(d) = m2.fetch().await.unwrap() {
        seen.insert(d.id);
        m2.ack(d.tag).await.unwrap();
    }
    let lost: Vec<u64> = confirmed.difference(&seen).copied().collect();
    assert!(lost.is_empty(), "confirmed messages lost: {lost:?}");
    assert_eq!(confirmed.len(), 160);
    wait_until("n3 follows the new master", async || {
        m3.stats()
            .await
            .is_some_and(|s| s.ready == 0 && s.unacked == 0)
    })
    .await;
    m2.stop().await;
    m3.stop().await;
    for n in nodes.values() {
        n.gm.shutdown();
        n.cluster.shutdown().await;
    }
}

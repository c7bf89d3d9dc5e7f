//! One node and a healthy three-node cluster.

use warren_cluster::{
    Arguments, ClusterError, Command, Outcome, QueueRecord, QueueView, Rejection,
};

use crate::harness::*;

pub fn queue(name: &str, master: &str, mirrors: &[&str]) -> QueueRecord {
    QueueRecord {
        vhost: "/".into(),
        name: name.into(),
        durable: true,
        exclusive_owner: None,
        auto_delete: false,
        arguments: Arguments::new(),
        master: master.into(),
        mirrors: mirrors.iter().map(|s| s.to_string()).collect(),
        synchronised: Vec::new(),
        view_version: 0,
        serial: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t10_one_node_bootstraps_commits_and_restarts_from_its_data_dir() {
    let mut tc = TestCluster::new(1);
    tc.snapshot_every = 5;
    let a = tc.start("a", None).await;
    assert!(a.is_leader());
    a.write(vhost("/")).await.unwrap();
    let Outcome::Queue(q) = a
        .write(Command::DeclareQueue(queue("q", "a", &[])))
        .await
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(q.view_version, 1);
    // Enough writes to take snapshots and compact the log.
    for i in 0..12 {
        a.write(vhost(&format!("v{i}"))).await.unwrap();
    }
    let md = a.read_linearizable().await.unwrap();
    assert_eq!(md.vhosts.len(), 13);
    assert_eq!(md.nodes["a"].peer_addr, "a");
    tc.kill("a").await;

    let a = tc.start("a", None).await;
    eventually(&a, "state restored", |m| {
        m.vhosts.len() == 13 && m.queue("/", "q").is_some()
    })
    .await;
    let status = a.cluster_status();
    assert_eq!(status.leader.as_deref(), Some("a"));
    assert_eq!(status.members.len(), 1);
    tc.shutdown_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t11_three_nodes_join_replicate_and_compare_and_set_views() {
    let mut tc = TestCluster::new(2);
    tc.form(&["a", "b", "c"]).await;
    let leader = tc.leader(&["a", "b", "c"]).await;
    let status = tc.node("c").cluster_status();
    assert_eq!(status.leader.as_deref(), Some(leader.as_str()));
    assert!(status.members.iter().all(|m| m.voter), "{status:?}");
    assert_eq!(status.members.len(), 3);

    // Writes from any node go through the leader.
    let follower = ["a", "b", "c"].into_iter().find(|n| *n != leader).unwrap();
    let f = tc.node(follower);
    f.write(vhost("/")).await.unwrap();
    f.write(Command::DeclareQueue(queue("q", "a", &["b"])))
        .await
        .unwrap();
    // Read your writes: the writer has applied it when `write` returns.
    assert!(f.local().queue("/", "q").is_some());
    // Compare-and-set: the first proposer at version 1 wins, the second loses.
    let view = QueueView {
        master: "a".into(),
        mirrors: vec!["b".into(), "c".into()],
        synchronised: vec!["b".into()],
    };
    let q = tc
        .node("b")
        .set_queue_view("/", "q", 1, 1, view.clone())
        .await
        .unwrap();
    assert_eq!(q.view_version, 2);
    let err = tc
        .node("c")
        .set_queue_view("/", "q", 1, 1, view)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ClusterError::Rejected(Rejection::ViewConflict {
                expected: 1,
                current: 2
            })
        ),
        "{err}"
    );
    // Ring views (opaque to the store) follow the same compare-and-set rule.
    let r = tc.node("c").set_ring_view("/q", 0, vec![7]).await.unwrap();
    assert_eq!(r.version, 1);
    let err = tc
        .node("a")
        .set_ring_view("/q", 0, vec![8])
        .await
        .unwrap_err();
    assert!(
        matches!(err, ClusterError::Rejected(Rejection::ViewConflict { .. })),
        "{err}"
    );
    // A linearizable read on any node sees the committed view.
    for name in ["a", "b", "c"] {
        let md = tc.node(name).read_linearizable().await.unwrap();
        let q = md.queue("/", "q").unwrap();
        assert_eq!(
            (q.view_version, q.synchronised.clone()),
            (2, vec!["b".to_string()])
        );
        assert_eq!(md.nodes.len(), 3);
        assert_eq!(md.rings["/q"].view, vec![7]);
    }
    tc.shutdown_all().await;
}

/// Four nodes asking to join at once (as when a whole cluster is started
/// together): membership changes are serialised, every one gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t12_concurrent_joins_all_become_voters() {
    let mut tc = TestCluster::new(12);
    tc.start("a", None).await;
    let joiners = ["b", "c", "d", "e"];
    let starts: Vec<_> = joiners
        .iter()
        .map(|name| tokio::spawn(warren_cluster::Cluster::start(tc.config(name, Some("a")))))
        .collect();
    for (name, start) in joiners.iter().zip(starts) {
        let node = tokio::time::timeout(LIMIT, start)
            .await
            .expect("join hung")
            .unwrap()
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        tc.nodes.insert(name.to_string(), node);
    }
    let status = tc.node("a").cluster_status();
    assert_eq!(status.members.len(), 5, "{status:?}");
    assert!(status.members.iter().all(|m| m.voter), "{status:?}");
    let md = tc.node("e").read_linearizable().await.unwrap();
    assert_eq!(md.nodes.len(), 5);
    tc.shutdown_all().await;
}

/// The handle is shared across tasks.
#[test]
fn the_cluster_handle_is_send_sync_and_clone() {
    fn check<T: Send + Sync + Clone + 'static>() {}
    check::<warren_cluster::Cluster>();
}

/// The store also runs on a current-thread runtime (as a single-threaded
/// node shell would use).
#[tokio::test]
async fn t13_runs_on_a_current_thread_runtime() {
    let mut tc = TestCluster::new(13);
    tc.form(&["a", "b"]).await;
    tc.node("b").write(vhost("/")).await.unwrap();
    let md = tc.node("a").read_linearizable().await.unwrap();
    assert!(md.vhosts.contains("/"));
    tc.shutdown_all().await;
}

/// Linearizable reads at once, on a follower, share round trips to the
/// leader (a failover of many queues reads once per ring), and each still
/// sees every write committed before it began.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t14_linearizable_reads_at_once_share_round_trips() {
    let (mut tc, leader, follower) = three_nodes(14).await;
    let w = tc.node(&leader).clone();
    let f = tc.node(follower).clone();
    let before = f.read_round_trips();
    let mut reads = Vec::new();
    for i in 0..10 {
        w.write(vhost(&format!("v{i}"))).await.unwrap();
        for _ in 0..20 {
            let f = f.clone();
            let name = format!("v{i}");
            reads.push(tokio::spawn(async move {
                let md = f.read_linearizable().await.unwrap();
                assert!(md.vhosts.contains(&name), "{name} written before the read");
            }));
        }
    }
    for r in reads {
        r.await.unwrap();
    }
    let trips = f.read_round_trips() - before;
    assert!(trips < 200, "{trips} round trips for 200 reads");
    tc.shutdown_all().await;
}

/// Writes at once on a follower go to the leader together, each with its
/// own outcome: a compare-and-set that conflicts is refused alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t15_writes_at_once_share_round_trips_and_keep_their_own_outcomes() {
    let (mut tc, _, follower) = three_nodes(15).await;
    let f = tc.node(follower).clone();
    let before = f.write_round_trips();
    let mut writes = Vec::new();
    for i in 0..100 {
        let f = f.clone();
        writes.push(tokio::spawn(async move {
            // Ring r{i} at version 0: set once; ring "same" by all: one wins.
            let mine = f.set_ring_view(&format!("r{i}"), 0, vec![i as u8]).await;
            let shared = f.set_ring_view("same", 0, vec![i as u8]).await;
            (mine, shared)
        }));
    }
    let mut won = 0;
    for w in writes {
        let (mine, shared) = w.await.unwrap();
        assert_eq!(mine.unwrap().version, 1);
        match shared {
            Ok(r) => {
                won += 1;
                assert_eq!(r.version, 1);
            }
            Err(e) => assert!(
                matches!(e, ClusterError::Rejected(Rejection::ViewConflict { .. })),
                "{e}"
            ),
        }
    }
    assert_eq!(won, 1, "one compare-and-set of the shared ring wins");
    let md = f.read_linearizable().await.unwrap();
    assert!((0..100).all(|i| md.rings[&format!("r{i}")].view == vec![i as u8]));
    let trips = f.write_round_trips() - before;
    assert!(trips < 200, "{trips} round trips for 200 writes");
    tc.shutdown_all().await;
}

/// A formed cluster of a, b and c (test id `id`), its leader and a follower.
async fn three_nodes(id: u64) -> (TestCluster, String, &'static str) {
    let mut tc = TestCluster::new(id);
    tc.form(&["a", "b", "c"]).await;
    let leader = tc.leader(&["a", "b", "c"]).await;
    let follower = ["a", "b", "c"].into_iter().find(|n| *n != leader).unwrap();
    (tc, leader, follower)
}

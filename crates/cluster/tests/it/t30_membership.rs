//! Membership: forget (online and offline), graceful stop, boot ordering.

use std::time::Duration;

use warren_cluster::offline::{forget_cluster_node_offline, read_metadata_offline};
use warren_cluster::{Cluster, ClusterError, Command, QueueView};
use warren_transport::TransportError;

use crate::harness::*;
use crate::t10_basic::queue;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t30_forget_a_stopped_node_online_promotes_its_queues() {
    let mut tc = TestCluster::new(30);
    tc.form(&["a", "b", "c"]).await;
    let a = tc.node("a");
    a.write(vhost("/")).await.unwrap();
    a.write(Command::DeclareQueue(queue("q", "c", &["a", "b"])))
        .await
        .unwrap();
    a.set_queue_view(
        "/",
        "q",
        1, // the first queue declared
        1,
        QueueView {
            master: "c".into(),
            mirrors: vec!["a".into(), "b".into()],
            synchronised: vec!["b".into()],
        },
    )
    .await
    .unwrap();
    a.write(Command::DeclareQueue(queue("lonely", "c", &[])))
        .await
        .unwrap();

    // Forgetting a running node is refused; so are non-members and oneself.
    eventually_up(&a, "b").await;
    let err = a.forget_cluster_node(&n("b")).await.unwrap_err();
    assert!(matches!(err, ClusterError::NodeRunning(_)), "{err}");
    let err = a.forget_cluster_node(&n("zz")).await.unwrap_err();
    assert!(matches!(err, ClusterError::NotAMember(_)), "{err}");
    let err = a.forget_cluster_node(&n("a")).await.unwrap_err();
    assert!(matches!(err, ClusterError::ForgetSelf), "{err}");

    tc.kill("c").await;
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        match a.forget_cluster_node(&n("c")).await {
            Ok(()) => break,
            Err(
                ClusterError::NodeRunning(_)
                | ClusterError::NoMajority { .. }
                | ClusterError::Remote(_),
            ) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("forget c: {e}"),
        }
    }
    let md = tc.node("b").read_linearizable().await.unwrap();
    let q = md.queue("/", "q").unwrap();
    assert_eq!(q.master, "b", "the synchronised mirror is promoted");
    assert_eq!(q.mirrors, vec!["a".to_string()]);
    assert!(md.queue("/", "lonely").is_none(), "no mirror to promote");
    assert!(!md.nodes.contains_key("c"));
    let status = a.cluster_status();
    assert_eq!(status.members.len(), 2, "{status:?}");
    // Two voters left: still a majority with both up.
    write_eventually(&tc.node("b"), vhost("after-forget")).await;

    // The forgotten node restarted with its old data cannot get back in: it
    // is told it was removed, and its elections are refused.
    tc.boot_wait_timeout = Duration::from_millis(400);
    tc.boot_wait_retries = 3;
    let cfg = tc.config("c", None);
    let err = tc.start_with(cfg).await.unwrap_err();
    // (Told by the member it asks; a node that knows no leader times out.)
    assert!(
        matches!(
            err,
            ClusterError::Removed(_) | ClusterError::BootTimeout { .. }
        ),
        "{err}"
    );
    write_eventually(&tc.node("b"), vhost("still-fine")).await;
    assert_eq!(tc.node("a").cluster_status().members.len(), 2);
    tc.shutdown_all().await;
}

async fn eventually_up(c: &Cluster, peer: &str) {
    let mut up = c.up_nodes();
    tokio::time::timeout(LIMIT, up.wait_for(|s| s.contains(&n(peer))))
        .await
        .expect("peer never up")
        .unwrap();
}

/// Seed scenario 4: every node stopped, the others gone for good: forget them
/// offline on the survivor's data directory, and it starts alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t31_forget_offline_lets_a_survivor_start_alone() {
    let mut tc = TestCluster::new(31);
    tc.snapshot_every = 4;
    tc.form(&["a", "b", "c"]).await;
    let b = tc.node("b");
    b.write(vhost("/")).await.unwrap();
    b.write(Command::DeclareQueue(queue("q", "c", &["a"])))
        .await
        .unwrap();
    b.set_queue_view(
        "/",
        "q",
        1, // the first queue declared
        1,
        QueueView {
            master: "c".into(),
            mirrors: vec!["a".into()],
            synchronised: vec!["a".into()],
        },
    )
    .await
    .unwrap();
    for i in 0..6 {
        b.write(vhost(&format!("v{i}"))).await.unwrap();
    }
    eventually(&tc.node("a"), "all writes", |m| m.vhosts.contains("v5")).await;
    tc.shutdown_all().await;

    let dir = tc.data_dir("a");
    // Error cases first: they change nothing.
    assert!(matches!(
        forget_cluster_node_offline(&dir, &n("a"), &[n("a")]),
        Err(ClusterError::ForgetSelf)
    ));
    assert!(matches!(
        forget_cluster_node_offline(&dir, &n("a"), &[n("zz")]),
        Err(ClusterError::NotAMember(_))
    ));
    let empty = tempfile::tempdir().unwrap();
    assert!(matches!(
        forget_cluster_node_offline(empty.path(), &n("a"), &[n("b")]),
        Err(ClusterError::BadDataDir(_))
    ));

    let report = forget_cluster_node_offline(&dir, &n("a"), &[n("b"), n("c")]).unwrap();
    assert_eq!(report.voters, vec!["a".to_string()]);
    let md = read_metadata_offline(&dir).unwrap();
    assert_eq!(md.queue("/", "q").unwrap().master, "a");

    let a = tc.start("a", None).await;
    let md = a.read_linearizable().await.unwrap();
    assert!(md.vhosts.contains("v5"));
    assert_eq!(md.queue("/", "q").unwrap().master, "a");
    assert_eq!(md.nodes.keys().collect::<Vec<_>>(), vec!["a"]);
    a.write(vhost("alone")).await.unwrap();
    // It can grow again.
    tc.start("d", Some("a")).await;
    let md = tc.node("d").read_linearizable().await.unwrap();
    assert!(md.vhosts.contains("alone"));
    tc.shutdown_all().await;
}

/// Seed scenario 1 on two nodes: A stops cleanly, B carries on alone and
/// can change views; B stops last; both come back in either order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t32_two_nodes_survive_a_clean_stop_of_either() {
    let mut tc = TestCluster::new(32);
    tc.form(&["a", "b"]).await;
    let a = tc.node("a");
    a.write(vhost("/")).await.unwrap();
    a.write(Command::DeclareQueue(queue("q", "a", &["b"])))
        .await
        .unwrap();

    // A stops cleanly (whether or not it leads): B keeps a majority alone.
    a.leave().await.unwrap();
    tc.nodes.remove("a");
    tc.net.disconnect(&n("a"));
    tc.leader(&["b"]).await;
    let b = tc.node("b");
    let q = b
        .set_queue_view(
            "/",
            "q",
            1, // the first queue declared
            1,
            QueueView {
                master: "b".into(),
                mirrors: vec![],
                synchronised: vec![],
            },
        )
        .await
        .unwrap();
    assert_eq!(q.view_version, 2);
    let status = b.cluster_status();
    let a_status = status.members.iter().find(|m| m.name == "a").unwrap();
    assert!(!a_status.voter, "{status:?}");

    // B stops last (it stays the only voter), then A starts first and waits
    // for B, which starts within the boot wait.
    b.leave().await.unwrap();
    tc.nodes.remove("b");
    let cfg_a = tc.config("a", None);
    let start_a = tokio::spawn(Cluster::start(cfg_a));
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(!start_a.is_finished(), "A must wait for B");
    let b = tc.start("b", None).await;
    let a = tokio::time::timeout(LIMIT, start_a)
        .await
        .expect("A never started")
        .unwrap()
        .unwrap();
    tc.nodes.insert("a".into(), a.clone());
    // A is a voter again.
    let deadline = tokio::time::Instant::now() + LIMIT;
    while !b.cluster_status().members.iter().all(|m| m.voter) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            b.cluster_status()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let md = a.read_linearizable().await.unwrap();
    assert_eq!(md.queue("/", "q").unwrap().master, "b");

    // A crash (no hand-off) of either of two voters leaves no majority.
    tc.kill("a").await;
    let err = b.write(vhost("x")).await.unwrap_err();
    assert!(matches!(err, ClusterError::NoMajority { .. }), "{err}");
    tc.shutdown_all().await;
}

/// Boot ordering: a restarted node that cannot reach a majority waits, then
/// fails naming the nodes to start or forget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t33_boot_wait_times_out_naming_the_missing_nodes() {
    let mut tc = TestCluster::new(33);
    tc.form(&["a", "b", "c"]).await;
    tc.shutdown_all().await;
    tc.boot_wait_timeout = Duration::from_millis(400);
    tc.boot_wait_retries = 3;
    let cfg = tc.config("a", None);
    let err = tokio::time::timeout(LIMIT, tc.start_with(cfg))
        .await
        .expect("boot wait is bounded")
        .unwrap_err();
    match &err {
        ClusterError::BootTimeout { waiting_for, .. } => {
            assert_eq!(waiting_for, &vec!["b".to_string(), "c".to_string()]);
        }
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains("forget_cluster_node"), "{err}");

    // Two of three started within the window: the cluster comes back.
    tc.boot_wait_timeout = Duration::from_secs(2);
    let cfg_a = tc.config("a", None);
    let start_a = tokio::spawn(Cluster::start(cfg_a));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let c = tc.start("c", None).await;
    let a = tokio::time::timeout(LIMIT, start_a)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    tc.nodes.insert("a".into(), a);
    write_eventually(&c, vhost("back")).await;
    tc.shutdown_all().await;
}

/// A follower that stops cleanly leaves the voters; with it gone, the two
/// remaining voters both count. When it starts again it is a voter again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t34_a_follower_leaves_and_rejoins_as_a_voter_on_restart() {
    let mut tc = TestCluster::new(34);
    let names = ["a", "b", "c"];
    tc.form(&names).await;
    let leader = tc.leader(&names).await;
    let others: Vec<&str> = names.iter().copied().filter(|n| *n != leader).collect();
    let (leaver, other) = (others[0], others[1]);
    tc.node(leaver).leave().await.unwrap();
    tc.nodes.remove(leaver);
    let status = tc.node(&leader).cluster_status();
    let voters: Vec<&str> = status
        .members
        .iter()
        .filter(|m| m.voter)
        .map(|m| m.name.as_str())
        .collect();
    assert_eq!(voters.len(), 2, "{status:?}");
    assert!(!voters.contains(&leaver), "{status:?}");
    tc.node(other).write(vhost("two-voters")).await.unwrap();

    // It restarts, rejoins as a voter and catches up.
    let back = tc.start(leaver, None).await;
    eventually(&back, "the write made while it was away", |m| {
        m.vhosts.contains("two-voters")
    })
    .await;
    let deadline = tokio::time::Instant::now() + LIMIT;
    while !tc
        .node(&leader)
        .cluster_status()
        .members
        .iter()
        .all(|m| m.voter)
    {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Three voters again: one crash is survivable.
    tc.kill(other).await;
    write_eventually(&back, vhost("after")).await;
    tc.shutdown_all().await;
}

/// A cluster whose one member left the voters (a clean stop) and whose two
/// others stopped without a hand-off, started again all at once: the
/// member that left rejoins as a voter while the other two are still
/// electing a leader, and every node comes up. (With real processes a
/// rejoin whose call met a new term, or a link lost while both ends
/// dialled, gave up at once and the node did not start: `cargo xtask
/// cluster up` on a stopped cluster's data failed so on 2026-12-04. It is
/// now asked again until the boot deadline.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t35_a_cluster_stopped_in_turn_starts_again_all_at_once() {
    for round in 0..5u64 {
        let mut tc = TestCluster::new(350 + round);
        let names = ["a", "b", "c"];
        tc.form(&names).await;
        tc.node("a").write(vhost("before")).await.unwrap();
        // `c` leaves the voters; `b` and `a` stop without a hand-off (as
        // when the last two stop at once), both still voters.
        let _ = tc.node("c").leave().await;
        tc.kill("c").await;
        tc.kill("b").await;
        tc.kill("a").await;
        let cfgs: Vec<_> = ["c", "b", "a"]
            .iter()
            .map(|name| tc.config(name, None))
            .collect();
        let mut starts = tokio::task::JoinSet::new();
        for cfg in cfgs {
            starts.spawn(async move {
                let name = cfg.node.to_string();
                // (Retried while the old listener is still registered.)
                let mut tries = 0;
                let r = loop {
                    match Cluster::start(cfg.clone()).await {
                        Err(ClusterError::Transport(TransportError::Listen { .. }))
                            if tries < 50 =>
                        {
                            tries += 1;
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        other => break other,
                    }
                };
                (name, r)
            });
        }
        let started = tokio::time::timeout(LIMIT, starts.join_all())
            .await
            .expect("the restart hung");
        for (name, r) in started {
            let c = r.unwrap_or_else(|e| panic!("round {round}: {name} did not start: {e}"));
            tc.nodes.insert(name, c);
        }
        for name in names {
            eventually(&tc.node(name), "the write made before the stop", |m| {
                m.vhosts.contains("before")
            })
            .await;
        }
        write_eventually(&tc.node("c"), vhost("after")).await;
        tc.shutdown_all().await;
    }
}

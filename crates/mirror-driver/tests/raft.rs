//! The same failover with the metadata in Raft: three nodes over the
//! in-memory transport, each a real `warren_cluster::Cluster` (the queue
//! record and the ring's views, compare-and-set through the log; the up set
//! from its failure detector), a real broker and the production
//! `MirrorDriver`, every task of a node on a runtime of its own. The
//! master's node is killed (its runtime shut down, its connections cut)
//! under confirmed publishing; the oldest synchronised mirror is promoted
//! through Raft and no confirmed message is lost.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::{
    Client, Node, QUEUE, init_tracing, name, queue_commands, runtime, transport, wait_until,
};
use tempfile::TempDir;
use warren_cluster::{Cluster, ClusterConfig, QueueRecord};
use warren_mirror::Role;
use warren_transport::PeerAddr;
use warren_transport::mem::MemNetwork;

/// Starts node `n`'s Raft member on `rt` (joining through `n1`).
async fn cluster(
    rt: &tokio::runtime::Runtime,
    mem: &MemNetwork,
    n: &str,
    dir: &TempDir,
) -> Cluster {
    let mut c = ClusterConfig::new(
        name(n),
        PeerAddr::new(n),
        dir.path().join("raft"),
        transport(mem, n),
    );
    c.join = (n != "n1").then(|| PeerAddr::new("n1"));
    c.raft_heartbeat_interval = Duration::from_millis(50);
    c.election_timeout_min = Duration::from_millis(250);
    c.election_timeout_max = Duration::from_millis(500);
    c.command_timeout = Duration::from_secs(2);
    c.heartbeat_interval = Duration::from_millis(100);
    c.failure_timeout = Duration::from_millis(600);
    c.boot_wait_timeout = Duration::from_secs(2);
    c.boot_wait_retries = 5;
    rt.spawn(Cluster::start(c))
        .await
        .unwrap()
        .expect("cluster node")
}

fn record(c: &Cluster) -> Option<QueueRecord> {
    c.local().queue("/", QUEUE).cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raft_backed_failover_keeps_every_confirmed_message() {
    init_tracing();
    let mem = MemNetwork::new(21);
    let mut dirs = BTreeMap::new();
    let mut pending = BTreeMap::new();
    for n in ["n1", "n2", "n3"] {
        let dir = tempfile::tempdir().unwrap();
        let rt = runtime();
        let c = cluster(&rt, &mem, n, &dir).await;
        dirs.insert(n, dir);
        pending.insert(n, (rt, c));
    }
    let c1 = pending["n1"].1.clone();
    for cmd in queue_commands(32) {
        c1.write(cmd).await.unwrap();
    }
    // Each node starts from its own copy of the record.
    for n in ["n2", "n3"] {
        let c = pending[n].1.clone();
        wait_until("the queue record on n2 and n3", || record(&c).is_some()).await;
    }
    let mut nodes: BTreeMap<&str, (Node<Cluster>, Cluster)> = BTreeMap::new();
    for n in ["n1", "n2", "n3"] {
        let (rt, c) = pending.remove(n).unwrap();
        let node = Node::start(rt, &mem, n, dirs[n].path(), c.clone()).await;
        nodes.insert(n, (node, c));
        if n == "n2" {
            // n2 is the older mirror: it is synchronised before n3 starts.
            wait_until("n2 synchronised in the record", || {
                record(&c1).is_some_and(|q| q.synchronised == ["n2"])
            })
            .await;
        }
    }
    wait_until("both mirrors synchronised in the record", || {
        record(&c1).is_some_and(|q| q.synchronised.len() == 2)
    })
    .await;

    let mut c = Client::connect(&nodes["n1"].0.broker);
    c.publish_confirmed(1..=100).await;
    // A batch in flight, and n1 dies: its runtime (Raft, GM, driver) and
    // its connections.
    for seq in 101..=130 {
        c.publish(seq, true);
    }
    c.poll();
    let mut confirmed: BTreeSet<u64> = c.acked.clone();
    let unknown = c.unsettled();
    let (dead, _) = nodes.remove("n1").unwrap();
    dead.rt.shutdown_background();
    mem.disconnect(&name("n1"));

    // n2 is the oldest synchronised mirror and normally promoted. On a
    // loaded machine n2 and n3 may suspect each other for a moment as n1
    // dies: the ring then removes n2's member, n2 comes back as a new,
    // unsynchronised mirror, and n3 (then the only synchronised one) is
    // promoted instead, as RabbitMQ would.
    let c2 = nodes["n2"].1.clone();
    wait_until("the record names a surviving node master", || {
        record(&c2).is_some_and(|q| q.master == "n2" || q.master == "n3")
    })
    .await;
    let (new, other) = if record(&c2).unwrap().master == "n2" {
        ("n2", "n3")
    } else {
        ("n3", "n2")
    };
    let master = &nodes[new].0;
    wait_until("the new master's replica is master", || {
        master.role() == Some(Role::Master)
    })
    .await;
    // The other stays (or, after a false suspicion, is again) a mirror.
    wait_until("the other replica is a mirror", || {
        nodes[other].0.role() == Some(Role::Mirror)
    })
    .await;
    // Its reconciler points its broker's queue at it on its next pass
    // (these nodes have no forwarding links).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut c = Client::connect(&master.broker);
    confirmed.extend(
        c.publish_confirmed(unknown.into_iter().chain(131..=160))
            .await,
    );
    let seen: BTreeSet<u64> = c.drain().await.iter().map(|g| g.seq).collect();
    let lost: Vec<u64> = confirmed.difference(&seen).copied().collect();
    assert!(lost.is_empty(), "confirmed messages lost: {lost:?}");
    assert_eq!(confirmed.len(), 160);
    wait_until("the other node follows the new master", || {
        nodes[other].0.counts() == (0, 0)
    })
    .await;
    // (Stopping a node's runtime stops its Raft member too.)
    for (_, (node, _)) in nodes {
        node.stop().await;
    }
}

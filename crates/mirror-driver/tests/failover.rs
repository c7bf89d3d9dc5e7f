//! The production mirror driver over the in-memory transport: three nodes,
//! each a real broker fed AMQP frames, its `MirrorDriver` (GM node,
//! reconciler, replica tasks) on a runtime of its own, the metadata in
//! memory (`MemMetadata`, the Raft state machine's own commands). Ported
//! from the tests of `warren_mirror`'s former test-only driver.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{Client, Net, wait_until};
use warren_mirror::Role;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn master_killed_under_confirmed_publishing_loses_nothing() {
    let mut net = Net::new(11, 16);
    net.start("n1").await;
    net.start("n2").await;
    // n2 is the older mirror: it is synchronised before n3 starts.
    wait_until("n2 synchronised in the record", || {
        net.record().synchronised == ["n2"]
    })
    .await;
    net.start("n3").await;
    wait_until("both mirrors synchronised in the record", || {
        net.record().synchronised.len() == 2
    })
    .await;
    let rec = net.record();
    assert_eq!(rec.master, "n1");
    assert_eq!(rec.synchronised, ["n2", "n3"]);

    let mut c1 = Client::connect(&net.nodes["n1"].broker);
    for batch in 0..10u64 {
        c1.publish_confirmed(batch * 20 + 1..=batch * 20 + 20).await;
    }
    let mut confirmed = c1.acked.clone();
    assert_eq!(confirmed.len(), 200);
    // Five deliveries left unacked: they come back redelivered.
    let mut unacked = BTreeSet::new();
    for _ in 0..5 {
        let g = c1.get().await.expect("a message");
        assert!(!g.redelivered);
        unacked.insert(g.seq);
    }
    // A batch in flight, and the master's node dies.
    for seq in 201..=240 {
        c1.publish(seq, true);
    }
    c1.poll();
    confirmed.extend(c1.acked.iter().copied());
    let unknown: Vec<u64> = c1.unsettled();
    net.kill("n1");

    // The oldest synchronised mirror takes over.
    wait_until("n2 master in the record", || net.record().master == "n2").await;
    wait_until("n2's replica is master", || {
        net.nodes["n2"].role() == Some(Role::Master)
    })
    .await;
    assert_eq!(net.nodes["n3"].role(), Some(Role::Mirror));
    // n2's reconciler points its broker's queue at n2 on its next pass
    // (until then n2 would forward publishes to n1; these nodes have no
    // forwarding links): give it a few passes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // What the dead master had not confirmed is published again, then more.
    let mut c2 = Client::connect(&net.nodes["n2"].broker);
    confirmed.extend(
        c2.publish_confirmed(unknown.into_iter().chain(241..=300))
            .await,
    );
    // Drain the new master: every confirmed message comes out, and the
    // deliveries the old master had handed out come back redelivered.
    let got = c2.drain().await;
    let seen: BTreeSet<u64> = got.iter().map(|g| g.seq).collect();
    let redelivered: BTreeSet<u64> = got
        .iter()
        .filter(|g| g.redelivered)
        .map(|g| g.seq)
        .collect();
    let lost: Vec<u64> = confirmed.difference(&seen).copied().collect();
    assert!(lost.is_empty(), "confirmed messages lost: {lost:?}");
    assert_eq!(confirmed.len(), 300);
    assert!(
        unacked.is_subset(&redelivered),
        "unacked at the old master {unacked:?}, redelivered {redelivered:?}"
    );
    // The surviving mirror follows the new master.
    wait_until("n3 holds what n2 holds", || {
        net.nodes["n3"].counts() == net.nodes["n2"].counts()
    })
    .await;
    net.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_mirror_syncs_while_publishing_and_restarted_mirror_resyncs() {
    let mut net = Net::new(12, 3);
    net.start("n1").await;
    net.start("n2").await;
    wait_until("n2 synchronised", || net.record().synchronised == ["n2"]).await;
    let mut c1 = Client::connect(&net.nodes["n1"].broker);
    assert_eq!(c1.publish_confirmed(1..=300).await.len(), 300);
    // Ten deliveries unacked: they are synced too.
    for _ in 0..10 {
        c1.get().await.expect("a message");
    }

    // A third node joins while publishing goes on; batches of 3 messages.
    net.start("n3").await;
    let mut seq = 301;
    while !net.record().synchronised.contains(&"n3".to_owned()) {
        c1.publish_confirmed([seq, seq + 1]).await;
        seq += 2;
        if let Some(p) = net.nodes["n1"].status().and_then(|s| s.syncing) {
            assert!(p.synced <= p.total);
        }
        assert!(seq < 100_000, "n3 never synchronised");
    }
    // (Its own status follows the master's next synchronised set.)
    wait_until("n3 reports itself synchronised", || {
        net.nodes["n3"].status().is_some_and(|s| s.synchronised)
    })
    .await;
    wait_until("n3 holds what the master holds", || {
        net.nodes["n3"].counts() == net.nodes["n1"].counts()
    })
    .await;
    assert_eq!(net.nodes["n1"].counts().1, 10);

    // n3 restarts: it comes back empty and unsynchronised, then resyncs.
    net.kill("n3");
    wait_until("n3 dropped from the synchronised mirrors", || {
        !net.record().synchronised.contains(&"n3".to_owned())
    })
    .await;
    c1.publish_confirmed([seq]).await;
    net.start("n3").await;
    wait_until(
        "restarted n3 synchronised and holding what the master holds",
        || {
            net.nodes["n3"].status().is_some_and(|s| s.synchronised)
                && net.nodes["n3"].counts() == net.nodes["n1"].counts()
        },
    )
    .await;
    wait_until("the record shows both mirrors synchronised", || {
        net.record().synchronised.len() == 2
    })
    .await;
    assert_eq!(net.record().master, "n1");
    net.stop().await;
}

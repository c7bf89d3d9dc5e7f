//! A mirror taking over from a dead master, on the simulated cluster of
//! `sim.rs` (`common`): the node's own mirror code, virtual time.

mod common;

use std::time::Duration;

use common::{Client, Net, QUEUE};
use warren_gm::{ViewAuthority, ViewChange};
use warren_mirror::Role;
use warren_mirror_driver::{ClusterViewAuthority, MetadataSource};

/// A mirror removed from its ring while its claim to the master's place is
/// still on its way to the metadata (a node that suspected it, as after a
/// partition's heal) keeps its copy and serves the queue from it once the
/// claim lands: every confirmed message comes back. Before, its copy went
/// with the replica, and its next replica started as a mirror of the
/// master the record named (itself): no node was master, for ever, and
/// the messages were gone with it (`cargo xtask chaos --seed 54003
/// --duration 90 --queues 4 --long-pauses --slow-links --unconfirmed`,
/// docs/faults.md, "A claim that landed after its replica left").
#[test]
fn a_mirror_removed_while_its_claim_to_be_master_is_on_its_way_serves_its_copy() {
    let step = Duration::from_millis(2);
    let limit = Duration::from_secs(30);
    let mut net = Net::simulated(7, 16);
    for n in ["n1", "n2", "n3"] {
        net.start_now(n);
    }
    net.step_until("n1 master, n2 and n3 synchronised", step, limit, |n| {
        n.nodes["n1"].role() == Some(Role::Master) && n.record().synchronised.len() == 2
    });
    let mut c = Client::connect(&net.nodes["n1"].broker);
    net.publish_confirmed_now(&mut c, 10, step, limit);
    c.disconnect();

    // The mirrors' metadata writes take 2 s to commit; the master dies.
    for n in ["n2", "n3"] {
        net.slow_writes(n, Duration::from_secs(2));
    }
    net.kill("n1");
    let mut claimant = None;
    net.step_until("a mirror claims the master's place", step, limit, |n| {
        claimant = ["n2", "n3"]
            .into_iter()
            .find(|m| common::lock(&n.nodes[*m].broker).replica_promoting("/", QUEUE));
        claimant.is_some()
    });
    let claimant = claimant.expect("a claimant");
    let other = if claimant == "n2" { "n3" } else { "n2" };

    // The other mirror dies too (its copy is not there to take over), and
    // the claimant's member is taken out of the ring meanwhile (another
    // node suspected it).
    net.kill(other);
    let ring = net.record().ring();
    let authority = ClusterViewAuthority::new(net.meta.clone());
    common::runtime().block_on(async {
        let view = authority.current(&ring).await.expect("the ring's view");
        let member = (view.entries.iter())
            .find(|e| e.alive && e.node.as_str() == claimant)
            .expect("the claimant's member")
            .id;
        authority
            .update(&ring, view.version, ViewChange::Remove(member))
            .await
            .expect("the claimant removed");
    });
    net.step_until("the claim landed", step, limit, |n| {
        n.meta.local().queue("/", QUEUE).unwrap().master == claimant
    });
    net.step_until(
        "the claimant's node serves the queue as master",
        step,
        limit,
        |n| n.nodes[claimant].role() == Some(Role::Master),
    );

    let mut c = Client::connect(&net.nodes[claimant].broker);
    let mut got = Vec::new();
    loop {
        c.request_get();
        let mut answer = None;
        net.step_until("a get", step, limit, |_| {
            answer = c.take_get();
            answer.is_some()
        });
        let Some(g) = answer.flatten() else { break };
        c.ack(g.tag);
        got.push(g.seq);
    }
    assert_eq!(got, (1..=10).collect::<Vec<u64>>());
    assert_eq!(c.closed(), None);
}

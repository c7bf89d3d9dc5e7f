//! Fault injection on the in-memory transport: cut, partition, delay, heal.

use std::time::Duration;

use bytes::Bytes;
use warren_transport::conformance::config;
use warren_transport::mem::MemNetwork;
use warren_transport::{Connection, Listener, NodeName, PeerAddr, Transport, TransportError};

fn n(s: &str) -> NodeName {
    NodeName::new(s).unwrap()
}

async fn node(
    net: &MemNetwork,
    name: &str,
) -> (warren_transport::mem::MemTransport, Box<dyn Listener>) {
    let t = net.transport(config(name, "s", 1024));
    let l = t.listen(&PeerAddr::new(name)).await.unwrap();
    (t, l)
}

async fn link(
    net: &MemNetwork,
    from: &str,
    to: &mut Box<dyn Listener>,
) -> (Connection, Connection) {
    let t = net.transport(config(from, "s", 1024));
    let addr = to.local_addr();
    let (c, s) = tokio::join!(t.connect(&addr), to.accept());
    (c.unwrap(), s.unwrap())
}

/// Checks that a receive failed because the connection was lost.
fn assert_lost(r: Result<Option<Bytes>, TransportError>) {
    assert!(
        matches!(r, Err(TransportError::ConnectionLost { .. })),
        "{r:?}"
    );
}

/// Sends `frame` on `tx` and checks that `rx` receives it.
async fn carries(tx: &mut Connection, rx: &mut Connection, frame: &'static [u8]) {
    tx.send(Bytes::from_static(frame)).await.unwrap();
    assert_eq!(rx.recv().await.unwrap().unwrap(), Bytes::from_static(frame));
}

#[tokio::test(start_paused = true)]
async fn cut_breaks_both_ends_and_refuses_new_links_until_healed() {
    let net = MemNetwork::new(1);
    let (_a, mut la) = node(&net, "a").await;
    let (b, _lb) = node(&net, "b").await;
    let (mut on_b, mut on_a) = link(&net, "b", &mut la).await;
    net.cut(&n("a"), &n("b"));
    assert_lost(on_a.recv().await);
    assert!(on_b.send(Bytes::from_static(b"x")).await.is_err());
    let err = b.connect(&PeerAddr::new("a")).await.unwrap_err();
    assert!(err.to_string().contains("cut"), "{err}");
    net.heal();
    let (mut on_b, mut on_a) = link(&net, "b", &mut la).await;
    carries(&mut on_b, &mut on_a, b"after heal").await;
}

#[tokio::test(start_paused = true)]
async fn heal_link_lifts_one_links_faults_and_leaves_the_others() {
    let net = MemNetwork::new(5);
    let (_a, mut la) = node(&net, "a").await;
    let (b, _lb) = node(&net, "b").await;
    let (c, _lc) = node(&net, "c").await;
    net.cut(&n("a"), &n("b"));
    net.cut(&n("a"), &n("c"));
    net.heal_link(&n("b"), &n("a"));
    let (mut on_b, mut on_a) = link(&net, "b", &mut la).await;
    carries(&mut on_b, &mut on_a, b"healed").await;
    let err = c.connect(&PeerAddr::new("a")).await.unwrap_err();
    assert!(err.to_string().contains("cut"), "{err}");
    drop(b);
}

#[tokio::test(start_paused = true)]
async fn a_link_that_lost_frames_to_a_blackhole_breaks_when_it_lifts() {
    let net = MemNetwork::new(6);
    let (_a, mut la) = node(&net, "a").await;
    let (_b, _lb) = node(&net, "b").await;
    let (mut on_b, mut on_a) = link(&net, "b", &mut la).await;
    let (mut on_b2, mut on_a2) = link(&net, "b", &mut la).await;
    net.blackhole(&n("b"), &n("a"));
    on_b.send(Bytes::from_static(b"lost")).await.unwrap();
    assert!(net.reaches(&n("a"), &n("b")));
    assert!(!net.reaches(&n("b"), &n("a")));
    net.heal_link(&n("a"), &n("b"));
    // The stream cannot carry on past the hole; the other link lost nothing.
    assert_lost(on_a.recv().await);
    assert!(on_b.send(Bytes::from_static(b"x")).await.is_err());
    carries(&mut on_b2, &mut on_a2, b"kept").await;
}

#[tokio::test(start_paused = true)]
async fn partition_separates_groups_but_not_members_of_one_group() {
    let net = MemNetwork::new(2);
    let (_a, mut la) = node(&net, "a").await;
    let (_b, mut lb) = node(&net, "b").await;
    let (c, _lc) = node(&net, "c").await;
    let (_c_to_a, mut a_from_c) = link(&net, "c", &mut la).await;
    let (mut c_to_b, mut b_from_c) = link(&net, "c", &mut lb).await;
    net.partition(&[&[n("a")], &[n("b"), n("c")]]);
    assert!(a_from_c.recv().await.is_err(), "a is cut off from c");
    carries(&mut c_to_b, &mut b_from_c, b"same side").await;
    let err = c.connect(&PeerAddr::new("a")).await.unwrap_err();
    assert!(err.to_string().contains("partitions"), "{err}");
}

#[tokio::test(start_paused = true)]
async fn delay_holds_frames_back_but_keeps_their_order() {
    let net = MemNetwork::new(3);
    let (_a, mut la) = node(&net, "a").await;
    let (mut to_a, mut on_a) = link(&net, "b", &mut la).await;
    net.delay(
        &n("a"),
        &n("b"),
        Duration::from_millis(100),
        Duration::from_millis(50),
    );
    let start = tokio::time::Instant::now();
    for i in 0..50u8 {
        to_a.send(Bytes::from(vec![i])).await.unwrap();
    }
    for i in 0..50u8 {
        assert_eq!(on_a.recv().await.unwrap().unwrap()[0], i);
    }
    // Virtual time: the delay is exact, not a wall-clock measurement.
    assert!(start.elapsed() >= Duration::from_millis(100));
}

#[tokio::test(start_paused = true)]
async fn disconnect_breaks_a_nodes_links_but_it_can_reconnect() {
    let net = MemNetwork::new(4);
    let (_a, mut la) = node(&net, "a").await;
    let (_to_a, mut on_a) = link(&net, "b", &mut la).await;
    net.disconnect(&n("b"));
    assert!(on_a.recv().await.is_err());
    let (mut to_a, mut on_a) = link(&net, "b", &mut la).await;
    to_a.send(Bytes::from_static(b"back")).await.unwrap();
    assert_eq!(
        on_a.recv().await.unwrap().unwrap(),
        Bytes::from_static(b"back")
    );
}

/// The same seed gives the same delivery times: runs are reproducible.
#[test]
fn same_seed_same_schedule() {
    fn run(seed: u64) -> Vec<Duration> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(async {
            let net = MemNetwork::new(seed);
            let (_a, mut la) = node(&net, "a").await;
            let (mut to_a, mut on_a) = link(&net, "b", &mut la).await;
            net.delay(
                &n("a"),
                &n("b"),
                Duration::from_millis(1),
                Duration::from_millis(20),
            );
            let start = tokio::time::Instant::now();
            let mut times = Vec::new();
            for i in 0..20u8 {
                to_a.send(Bytes::from(vec![i])).await.unwrap();
                on_a.recv().await.unwrap().unwrap();
                times.push(start.elapsed());
            }
            times
        })
    }
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));
}

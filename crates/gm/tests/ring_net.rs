//! The same ring test over the in-memory transport, TCP and QUIC: five
//! members on five nodes broadcast; one node crashes; a sixth node joins;
//! then the guarantees are checked on what every member delivered. Also: a
//! short cut heals without a view change, a link whose frames vanish is
//! replaced, a large broadcast holds back no other ring, a suspicion that heals while its removal cannot commit (a
//! minority) removes nobody, a member that joins beside a node that
//! suspects its node is removed, and a node joins no ring beside a node it
//! suspects.

use std::collections::BTreeMap;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use bytes::Bytes;
use warren_gm::{
    FailureDetector, GmNode, HeartbeatDetector, InMemoryAuthority, MemberId, NodeConfig, RingEvent,
    RingHandle, View, ViewAuthority, ViewChange, ViewError, ViewVersion,
};
use warren_tls::ClusterCa;
use warren_transport::mem::MemNetwork;
use warren_transport::{
    ClusterSecret, Connection, FrameSender, NodeName, PeerAddr, Transport, TransportConfig,
    TransportError,
};
use warren_transport_quic::{QuicOptions, QuicTransport};
use warren_transport_tcp::TcpTransport;

static CA: LazyLock<ClusterCa> = LazyLock::new(|| ClusterCa::generate("gm-test").expect("CA"));

#[derive(Clone, Copy, Debug)]
enum Kind {
    Mem,
    Tcp,
    Quic,
}

struct Net {
    kind: Kind,
    mem: MemNetwork,
}

impl Net {
    /// The in-memory network, its faults drawn from `seed`.
    fn mem(seed: u64) -> Self {
        Self {
            kind: Kind::Mem,
            mem: MemNetwork::new(seed),
        }
    }

    fn transport(&self, node: &NodeName) -> Arc<dyn Transport> {
        let config = TransportConfig::new(node.clone(), ClusterSecret::new("gm-secret"));
        match self.kind {
            Kind::Mem => Arc::new(self.mem.transport(config)),
            Kind::Tcp => Arc::new(TcpTransport::new(config)),
            Kind::Quic => {
                let id = CA.issue(node.as_str()).expect("certificate");
                Arc::new(QuicTransport::new(config, &id, &QuicOptions::loopback()).expect("quic"))
            }
        }
    }

    fn listen_addr(&self, node: &NodeName) -> PeerAddr {
        match self.kind {
            Kind::Mem => PeerAddr::new(node.as_str()),
            Kind::Tcp | Kind::Quic => PeerAddr::new("127.0.0.1:0"),
        }
    }
}

/// What one member saw.
#[derive(Default, Debug)]
struct Seen {
    delivered: BTreeMap<MemberId, Vec<u64>>,
    confirmed: u64,
    views: Vec<u64>,
    removed: bool,
    /// Point-to-point messages, with their senders.
    messages: Vec<(MemberId, Bytes)>,
    /// Connections to nodes of the ring replaced (`RingEvent::LinkReset`).
    link_resets: u32,
}

type Shared = Arc<Mutex<Seen>>;

fn collect(handle: Arc<RingHandle>) -> Shared {
    let seen: Shared = Arc::default();
    let s = seen.clone();
    tokio::spawn(async move {
        let mut events = Vec::new();
        while handle.next_events(&mut events).await {
            let mut s = s.lock().unwrap();
            for e in events.drain(..) {
                match e {
                    RingEvent::Deliver {
                        publisher,
                        seq,
                        payload,
                    } => {
                        if payload.len() == LARGE.len() {
                            assert!(payload == *LARGE, "large payload");
                        } else {
                            assert_eq!(payload, payload_of(publisher, seq), "payload");
                        }
                        s.delivered.entry(publisher).or_default().push(seq);
                    }
                    RingEvent::Confirm { up_to } => s.confirmed = up_to,
                    RingEvent::View { version } => s.views.push(version),
                    RingEvent::Removed => s.removed = true,
                    RingEvent::Message { from, payload } => s.messages.push((from, payload)),
                    RingEvent::LinkReset => s.link_resets += 1,
                }
            }
        }
    });
    seen
}

fn payload_of(publisher: MemberId, seq: u64) -> Bytes {
    Bytes::from(format!("{}:{seq}", publisher.0))
}

/// A large payload (8 MiB) whose bytes differ along it, made once.
static LARGE: LazyLock<Bytes> = LazyLock::new(|| {
    (0..8usize << 20)
        .map(|i| (i % 251) as u8 ^ (i >> 16) as u8)
        .collect::<Vec<u8>>()
        .into()
});

async fn start_node(net: &Net, name: &str, authority: &Arc<InMemoryAuthority>) -> GmNode {
    // 2 s, not less: six nodes of a debug build dialing each other over QUIC
    // on a loaded 2-core machine went 400 ms without a heartbeat (10 of 180
    // runs, three at once), and a falsely suspected member is removed, so
    // the messages sent to it are rightly lost.
    let detector = HeartbeatDetector::new(Duration::from_millis(20), Duration::from_millis(2_000));
    start_node_with(net, name, authority.clone(), Box::new(detector)).await
}

async fn start_node_with(
    net: &Net,
    name: &str,
    authority: Arc<dyn ViewAuthority>,
    detector: Box<dyn FailureDetector>,
) -> GmNode {
    let node = NodeName::new(name).unwrap();
    let mut config = NodeConfig::new(node.clone(), net.listen_addr(&node));
    config.tick_interval = Duration::from_millis(5);
    config.redial_interval = Duration::from_millis(50);
    GmNode::start(config, net.transport(&node), authority, detector)
        .await
        .expect("start node")
}

/// Tells every node of `nodes` about every other.
async fn introduce(nodes: &[GmNode]) {
    for a in nodes {
        for b in nodes {
            if a.node() != b.node() {
                a.add_peer(b.node().clone(), b.local_addr().clone())
                    .await
                    .unwrap();
            }
        }
    }
}

/// `count` nodes that all know each other.
async fn cluster(
    net: &Net,
    prefix: &str,
    count: usize,
    authority: &Arc<InMemoryAuthority>,
) -> Vec<GmNode> {
    let mut nodes = Vec::new();
    for i in 1..=count {
        nodes.push(start_node(net, &format!("{prefix}{i}@gm"), authority).await);
    }
    introduce(&nodes).await;
    nodes
}

async fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    for _ in 0..3_000 {
        if ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("gave up waiting (30 s) for: {what}");
}

struct Member {
    handle: Arc<RingHandle>,
    seen: Shared,
    sent: u64,
}

async fn join(node: &GmNode) -> Member {
    let handle = Arc::new(node.join("q").await.expect("join"));
    let seen = collect(handle.clone());
    Member {
        handle,
        seen,
        sent: 0,
    }
}

/// Waits until every member's last view is at least `version`.
async fn wait_full_views(members: &[Member], version: u64) {
    wait_until("full views", || {
        members.iter().all(|m| {
            m.seen
                .lock()
                .unwrap()
                .views
                .last()
                .is_some_and(|&v| v >= version)
        })
    })
    .await;
}

/// Introduces `nodes` to each other, joins ring `q` on each and waits until
/// every member has the view with all of them.
async fn join_all(nodes: &[GmNode]) -> Vec<Member> {
    introduce(nodes).await;
    let mut members = Vec::new();
    for node in nodes {
        members.push(join(node).await);
    }
    wait_full_views(&members, nodes.len() as u64).await;
    members
}

async fn broadcast_round(members: &mut [Member], live: &[usize]) {
    for &i in live {
        let m = &mut members[i];
        let id = m.handle.member();
        let payloads: Vec<Bytes> = (1..=10).map(|k| payload_of(id, m.sent + k)).collect();
        if let Ok(last) = m.handle.broadcast(payloads).await {
            m.sent = last;
        }
    }
}

/// Waits until every member has every broadcast confirmed, and has
/// delivered every member's broadcasts exactly once, in order.
async fn wait_all_delivered_once(members: &[Member]) {
    wait_until("every broadcast confirmed and delivered", || {
        members.iter().all(|m| {
            let s = m.seen.lock().unwrap();
            s.confirmed == m.sent
                && members.iter().all(|p| {
                    s.delivered.get(&p.handle.member()).cloned()
                        == Some((1..=p.sent).collect::<Vec<_>>())
                })
        })
    })
    .await;
}

/// Each member's link resets since `before` (all of them if `before` is empty).
fn resets_since(members: &[Member], before: &[u32]) -> Vec<u32> {
    members
        .iter()
        .enumerate()
        .map(|(i, m)| m.seen.lock().unwrap().link_resets - before.get(i).copied().unwrap_or(0))
        .collect()
}

/// One member on each of `nodes`, joined one after the other; returns once
/// every member has installed the full view.
async fn join_in_turn(nodes: &[GmNode]) -> Vec<Member> {
    let mut members = Vec::new();
    for node in nodes {
        members.push(join(node).await);
        let n = members.len();
        wait_full_views(&members[n - 1..], n as u64).await;
    }
    wait_full_views(&members, nodes.len() as u64).await;
    members
}

/// Broadcast rounds from every member of a three-member ring (in view 3),
/// `fault` between the first two nodes from round `at.0` to a heal at
/// round `at.1`, `at.2` rounds in all; then checks that every broadcast is
/// confirmed and delivered once, that no view changed, and that the two
/// members whose link was replaced were told (point-to-point messages
/// between them may have been lost). Returns each member's link resets.
async fn through_fault(
    members: &mut [Member],
    authority: &InMemoryAuthority,
    at: (u32, u32, u32),
    fault: impl Fn(),
    net: &MemNetwork,
) -> Vec<u32> {
    let before = resets_since(members, &[]);
    for round in 0..at.2 {
        if round == at.0 {
            fault();
        }
        if round == at.1 {
            net.heal();
        }
        broadcast_round(members, &[0, 1, 2]).await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    wait_all_delivered_once(members).await;
    assert_eq!(authority.current_now("q").version, 3, "no view change");
    let resets = resets_since(members, &before);
    assert!(resets[0] >= 1 && resets[1] >= 1, "{resets:?}");
    resets
}

async fn ring_test(kind: Kind) {
    let net = Net {
        kind,
        mem: MemNetwork::new(7),
    };
    let authority = Arc::new(InMemoryAuthority::new());
    let nodes = cluster(&net, "n", 6, &authority).await;
    let mut members = Vec::new();
    for node in &nodes[..5] {
        members.push(join(node).await);
        let n = members.len();
        wait_full_views(&members[n - 1..], n as u64).await;
    }
    // Messages broadcast in a view without a member are not for it: start
    // once every member has installed the full view.
    wait_full_views(&members, 5).await;
    let mut live: Vec<usize> = (0..5).collect();
    for _ in 0..20 {
        broadcast_round(&mut members, &live).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Point-to-point messages: every member to every other, one hop each.
    let ids: Vec<MemberId> = members.iter().map(|m| m.handle.member()).collect();
    for m in &members {
        for &to in ids.iter().filter(|&&to| to != m.handle.member()) {
            let text = format!("{} to {}", m.handle.member().0, to.0);
            m.handle.send(to, Bytes::from(text)).await.unwrap();
        }
    }
    wait_until("every point-to-point message", || {
        members
            .iter()
            .all(|m| m.seen.lock().unwrap().messages.len() == 4)
    })
    .await;
    for m in &members {
        let me = m.handle.member();
        let mut got = m.seen.lock().unwrap().messages.clone();
        got.sort();
        let mut want: Vec<(MemberId, Bytes)> = ids
            .iter()
            .filter(|&&from| from != me)
            .map(|&from| (from, Bytes::from(format!("{} to {}", from.0, me.0))))
            .collect();
        want.sort();
        assert_eq!(got, want, "{kind:?}: messages to {}", me.0);
    }
    // Node 3 crashes mid-traffic.
    nodes[2].shutdown();
    live.retain(|&i| i != 2);
    for _ in 0..20 {
        broadcast_round(&mut members, &live).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    wait_until("the crashed member's removal", || {
        authority
            .current_now("q")
            .entry(members[2].handle.member())
            .is_none_or(|e| !e.alive)
    })
    .await;
    // A sixth node joins during traffic; nothing confirmed before may reach it.
    let confirmed_before: Vec<u64> = members
        .iter()
        .map(|m| m.seen.lock().unwrap().confirmed)
        .collect();
    members.push(join(&nodes[5]).await);
    live.push(5);
    for _ in 0..20 {
        broadcast_round(&mut members, &live).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    wait_until("every broadcast confirmed", || {
        live.iter().all(|&i| {
            let s = members[i].seen.lock().unwrap();
            s.confirmed == members[i].sent && !s.removed
        })
    })
    .await;
    // Guarantees.
    let ids: Vec<MemberId> = members.iter().map(|m| m.handle.member()).collect();
    for &i in &live {
        let seen = members[i].seen.lock().unwrap();
        for (j, &p) in ids.iter().enumerate() {
            let got = seen.delivered.get(&p).cloned().unwrap_or_default();
            // Exactly once, in order, without gaps.
            for w in got.windows(2) {
                assert_eq!(w[1], w[0] + 1, "{kind:?}: member {i} got {p} out of order");
            }
            if live.contains(&j) {
                assert_eq!(
                    got.last().copied().unwrap_or(0),
                    members[j].sent,
                    "{kind:?}: member {i} misses messages of {j}"
                );
            }
            if i == 5 && j != 5 {
                let first = got.first().copied().unwrap_or(u64::MAX);
                assert!(
                    first > confirmed_before[j],
                    "{kind:?}: the joiner delivered {p}#{first}, confirmed before it joined"
                );
            } else if j != 5 {
                assert_eq!(got.first().copied(), Some(1), "{kind:?}: member {i}, {j}");
            }
        }
    }
    // The crashed member's messages: everyone that stayed delivered the same prefix.
    let crashed = ids[2];
    let prefixes: Vec<usize> = [0usize, 1, 3, 4]
        .iter()
        .map(|&i| {
            members[i]
                .seen
                .lock()
                .unwrap()
                .delivered
                .get(&crashed)
                .map_or(0, Vec::len)
        })
        .collect();
    assert!(
        prefixes.windows(2).all(|w| w[0] == w[1]),
        "{kind:?}: {prefixes:?}"
    );
    for node in &nodes {
        node.shutdown();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_over_mem() {
    ring_test(Kind::Mem).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_over_tcp() {
    ring_test(Kind::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_over_quic() {
    ring_test(Kind::Quic).await;
}

/// Two rings share the nodes' connections; one ring has two members on one node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rings_share_connections_and_nodes() {
    let net = Net::mem(3);
    let authority = Arc::new(InMemoryAuthority::new());
    let nodes = cluster(&net, "s", 3, &authority).await;
    let mut rings: Vec<Vec<Member>> = vec![Vec::new(), Vec::new()];
    for (r, placement) in [[0usize, 1, 2], [0, 0, 1]].iter().enumerate() {
        for &n in placement {
            let handle = Arc::new(nodes[n].join(&format!("ring{r}")).await.expect("join"));
            let seen = collect(handle.clone());
            let want = rings[r].len() as u64 + 1;
            wait_until("the joiner's view", || {
                seen.lock()
                    .unwrap()
                    .views
                    .last()
                    .is_some_and(|&v| v >= want)
            })
            .await;
            rings[r].push(Member {
                handle,
                seen,
                sent: 0,
            });
        }
    }
    for members in &rings {
        wait_full_views(members, 3).await;
    }
    for _ in 0..10 {
        for members in &mut rings {
            broadcast_round(members, &[0, 1, 2]).await;
        }
    }
    for members in &rings {
        wait_until("every broadcast confirmed and delivered", || {
            members.iter().all(|m| {
                let s = m.seen.lock().unwrap();
                s.confirmed == m.sent
                    && members.iter().all(|p| {
                        s.delivered.get(&p.handle.member()).map(Vec::len) == Some(p.sent as usize)
                    })
            })
        })
        .await;
    }
}

/// A link cut shorter than the failure detector's timeout: the connection is
/// redialled, the neighbours resynchronise, and nothing is lost or doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_cut_heals_without_a_view_change() {
    let net = Net::mem(5);
    let authority = Arc::new(InMemoryAuthority::new());
    let nodes = cluster(&net, "c", 3, &authority).await;
    let mut members = join_in_turn(&nodes).await;
    let fault = || net.mem.cut(nodes[0].node(), nodes[1].node());
    let resets = through_fault(&mut members, &authority, (10, 20, 30), fault, &net.mem).await;
    // The third member's links were not replaced.
    assert_eq!(resets[2], 0, "{resets:?}");
}

/// A link whose frames vanish while both ends stay connected (a firewall
/// dropping packets; a TCP connection in retransmission backoff after a
/// cut) is replaced once silent for `silent_link_after`: after the heal
/// every broadcast is confirmed and delivered, without a view change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_link_is_replaced() {
    let net = Net::mem(11);
    let authority = Arc::new(InMemoryAuthority::new());
    let mut nodes = Vec::new();
    for i in 1..=3 {
        let node = NodeName::new(format!("s{i}@gm")).unwrap();
        let mut config = NodeConfig::new(node.clone(), net.listen_addr(&node));
        config.tick_interval = Duration::from_millis(5);
        config.redial_interval = Duration::from_millis(50);
        config.silent_link_after = Duration::from_millis(200);
        // Nobody is suspected: only the silence replaces the link.
        let detector = HeartbeatDetector::new(Duration::from_millis(20), Duration::from_secs(60));
        let transport = {
            let mut c = TransportConfig::new(node.clone(), ClusterSecret::new("gm-secret"));
            c.connect_timeout = Duration::from_millis(100);
            Arc::new(net.mem.transport(c))
        };
        let a = authority.clone();
        nodes.push(
            GmNode::start(config, transport, a, Box::new(detector))
                .await
                .expect("start node"),
        );
    }
    introduce(&nodes).await;
    let mut members = join_in_turn(&nodes).await;
    let (a, b) = (nodes[0].node(), nodes[1].node());
    let fault = || {
        net.mem.blackhole(a, b);
        net.mem.blackhole(b, a);
    };
    through_fault(&mut members, &authority, (10, 50, 60), fault, &net.mem).await;
}

/// A slow link: the connections a transport dials write at most
/// `bytes_per_ms` bytes a millisecond.
#[derive(Debug)]
struct Slow {
    inner: Arc<dyn Transport>,
    bytes_per_ms: usize,
}

#[async_trait::async_trait]
impl Transport for Slow {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    async fn listen(
        &self,
        addr: &PeerAddr,
    ) -> Result<Box<dyn warren_transport::Listener>, TransportError> {
        self.inner.listen(addr).await
    }

    async fn connect(&self, addr: &PeerAddr) -> Result<Connection, TransportError> {
        let conn = self.inner.connect(addr).await?;
        let peer = conn.peer_node().clone();
        let (inner, receiver) = conn.split();
        let sender = SlowSender {
            inner,
            bytes_per_ms: self.bytes_per_ms,
        };
        Ok(Connection::new(peer, Box::new(sender), receiver))
    }
}

#[derive(Debug)]
struct SlowSender {
    inner: Box<dyn FrameSender>,
    bytes_per_ms: usize,
}

impl SlowSender {
    /// How long writing what went since `before` takes.
    fn time_since(&self, before: usize) -> Duration {
        let written = before.saturating_sub(self.inner.buffered());
        Duration::from_millis((written / self.bytes_per_ms) as u64)
    }
}

#[async_trait::async_trait]
impl FrameSender for SlowSender {
    fn feed(&mut self, frame: Bytes) -> Result<(), TransportError> {
        self.inner.feed(frame)
    }
    fn feed_lane(&mut self, lane: u64, frame: Bytes) -> Result<(), TransportError> {
        self.inner.feed_lane(lane, frame)
    }
    fn buffered(&self) -> usize {
        self.inner.buffered()
    }
    async fn flush(&mut self) -> Result<(), TransportError> {
        let before = self.inner.buffered();
        self.inner.flush().await?;
        tokio::time::sleep(self.time_since(before)).await;
        Ok(())
    }
    async fn flush_some(&mut self) -> Result<(), TransportError> {
        let before = self.inner.buffered();
        self.inner.flush_some().await?;
        tokio::time::sleep(self.time_since(before)).await;
        Ok(())
    }
    async fn close(&mut self) -> Result<(), TransportError> {
        self.inner.close().await
    }
}

/// A ring's 8 MiB broadcast, over a link that takes 2 s to carry it (in
/// pieces of 64 KiB over TCP), holds back neither another ring that shares
/// its connections nor the heartbeats: with nodes suspected after 1 s
/// without one and links replaced after 1 s of silence, every broadcast of
/// both rings is confirmed and delivered once, no view changes and no link
/// is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_broadcast_holds_back_neither_other_rings_nor_heartbeats() {
    LazyLock::force(&LARGE);
    let authority = Arc::new(InMemoryAuthority::new());
    let mut nodes = Vec::new();
    for i in 1..=3 {
        let node = NodeName::new(format!("l{i}@gm")).unwrap();
        let mut config = NodeConfig::new(node.clone(), PeerAddr::new("127.0.0.1:0"));
        config.tick_interval = Duration::from_millis(5);
        config.redial_interval = Duration::from_millis(50);
        config.silent_link_after = Duration::from_secs(1);
        let detector = HeartbeatDetector::new(Duration::from_millis(20), Duration::from_secs(1));
        let mut c = TransportConfig::new(node.clone(), ClusterSecret::new("gm-secret"));
        c.chunk_len = 64 << 10;
        let mut transport: Arc<dyn Transport> = Arc::new(TcpTransport::new(c));
        // The first node (which dials the others) publishes the large message.
        if i == 1 {
            transport = Arc::new(Slow {
                inner: transport,
                bytes_per_ms: 4 << 10,
            });
        }
        nodes.push(
            GmNode::start(config, transport, authority.clone(), Box::new(detector))
                .await
                .expect("start node"),
        );
    }
    introduce(&nodes).await;
    let mut rings: Vec<Vec<Member>> = Vec::new();
    for ring in ["large", "small"] {
        let mut members: Vec<Member> = Vec::new();
        for node in &nodes {
            let handle = Arc::new(node.join(ring).await.expect("join"));
            let seen = collect(handle.clone());
            members.push(Member {
                handle,
                seen,
                sent: 0,
            });
            let n = members.len();
            wait_full_views(&members[n - 1..], n as u64).await;
        }
        wait_full_views(&members, 3).await;
        rings.push(members);
    }
    let [large, small] = &mut rings[..] else {
        unreachable!("two rings")
    };
    large[0].sent = large[0]
        .handle
        .broadcast(vec![LARGE.clone()])
        .await
        .expect("broadcast");
    for _ in 0..50 {
        broadcast_round(small, &[0, 1, 2]).await;
        broadcast_round(large, &[0, 1, 2]).await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    wait_all_delivered_once(small).await;
    wait_all_delivered_once(large).await;
    for ring in ["large", "small"] {
        assert_eq!(authority.current_now(ring).version, 3, "no view change");
    }
    for members in &rings {
        assert_eq!(resets_since(members, &[]), [0, 0, 0], "no link replaced");
    }
    for node in &nodes {
        node.shutdown();
    }
}

/// A view authority as a node in a minority sees it: while `cut`, every
/// update is left undecided after a while (the Raft write timed out and
/// may still be applied), so the driver keeps retrying its proposals.
/// It counts its reads of either kind.
#[derive(Debug, Default)]
struct Minority {
    inner: Arc<InMemoryAuthority>,
    cut: std::sync::atomic::AtomicBool,
    /// Fresh reads (`current`).
    reads: std::sync::atomic::AtomicU64,
    /// Reads of this node's own copy (`current_local`).
    local_reads: std::sync::atomic::AtomicU64,
}

#[async_trait::async_trait]
impl ViewAuthority for Minority {
    async fn current(&self, ring: &str) -> Result<View, ViewError> {
        self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.current(ring).await
    }

    async fn current_local(&self, ring: &str) -> Result<View, ViewError> {
        self.local_reads
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.current(ring).await
    }

    async fn update(
        &self,
        ring: &str,
        expected: ViewVersion,
        change: ViewChange,
    ) -> Result<View, ViewError> {
        if self.cut.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
            return Err(ViewError::Unavailable(format!(
                "no majority (at version {expected})"
            )));
        }
        self.inner.update(ring, expected, change).await
    }
}

/// Suspects whatever the test says, once; heartbeats on every tick.
#[derive(Debug, Default)]
struct Scripted(Arc<Mutex<Vec<NodeName>>>);

impl FailureDetector for Scripted {
    fn watch(&mut self, _: &NodeName, _: tokio::time::Instant) {}
    fn heard_from(&mut self, _: &NodeName, _: tokio::time::Instant) {}
    fn heartbeat_due(&mut self, _: tokio::time::Instant) -> bool {
        true
    }
    fn poll_suspects(&mut self, _: tokio::time::Instant) -> Vec<NodeName> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

/// A node that suspected its peers while it could not change the view (a
/// minority) keeps retrying the removals; once it hears from them again
/// (the partition healed) it must not remove them any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspicion_healed_before_its_removal_commits_removes_nobody() {
    use std::sync::atomic::Ordering::SeqCst;
    let net = Net::mem(9);
    let inner = Arc::new(InMemoryAuthority::new());
    let minority = Arc::new(Minority {
        inner: inner.clone(),
        ..Minority::default()
    });
    let suspect = Arc::new(Mutex::new(Vec::new()));
    let mut nodes = Vec::new();
    for i in 1..=3 {
        let (authority, detector): (Arc<dyn ViewAuthority>, _) = if i == 1 {
            (minority.clone(), Scripted(suspect.clone()))
        } else {
            (inner.clone(), Scripted::default())
        };
        let name = format!("s{i}@gm");
        nodes.push(start_node_with(&net, &name, authority, Box::new(detector)).await);
    }
    let mut members = join_all(&nodes).await;

    minority.cut.store(true, SeqCst);
    let before = minority.reads.load(SeqCst);
    *suspect.lock().unwrap() = vec![nodes[1].node().clone(), nodes[2].node().clone()];
    // The removals were proposed (read the view), and refused.
    wait_until("the removals proposed", || {
        minority.reads.load(SeqCst) >= before + 2
    })
    .await;
    minority.cut.store(false, SeqCst);
    let all_reads = || minority.reads.load(SeqCst) + minority.local_reads.load(SeqCst);
    let healed = all_reads();
    wait_until("the node reading views again", || all_reads() >= healed + 3).await;
    broadcast_round(&mut members, &[0, 1, 2]).await;
    wait_until("every broadcast confirmed", || {
        members
            .iter()
            .all(|m| m.seen.lock().unwrap().confirmed == m.sent)
    })
    .await;
    let view = inner.current_now("q");
    assert_eq!(view.version, 3, "no member removed: {view:?}");
    assert!(members.iter().all(|m| !m.seen.lock().unwrap().removed));
}

/// A view authority whose joins commit late (a busy metadata store).
#[derive(Debug)]
struct SlowJoins(Arc<InMemoryAuthority>);

#[async_trait::async_trait]
impl ViewAuthority for SlowJoins {
    async fn current(&self, ring: &str) -> Result<View, ViewError> {
        self.0.current(ring).await
    }

    async fn update(
        &self,
        ring: &str,
        expected: ViewVersion,
        change: ViewChange,
    ) -> Result<View, ViewError> {
        if matches!(change, ViewChange::Join { .. }) {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        self.0.update(ring, expected, change).await
    }
}

/// A member that leaves before its join is committed must not stay in the
/// ring: alive in the view with nobody behind it, it would hold every
/// broadcast of the other members unconfirmed for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_leaves_before_its_join_commits_does_not_stay_in_the_ring() {
    let net = Net::mem(11);
    let inner = Arc::new(InMemoryAuthority::new());
    let slow: Arc<dyn ViewAuthority> = Arc::new(SlowJoins(inner.clone()));
    let mut nodes = Vec::new();
    for i in 1..=2 {
        let detector = HeartbeatDetector::new(Duration::from_millis(100), Duration::from_secs(30));
        nodes.push(
            start_node_with(&net, &format!("o{i}@gm"), slow.clone(), Box::new(detector)).await,
        );
    }
    introduce(&nodes).await;
    // Joins and leaves at once: the removal finds nothing to remove, then
    // the join commits.
    let gone = nodes[0].join("q").await.expect("join");
    let gone_id = gone.member();
    gone.leave().await;
    let mut members = vec![join(&nodes[1]).await];
    wait_until("the early leaver out of the view", || {
        let view = inner.current_now("q");
        view.version >= 2 && view.entry(gone_id).is_none_or(|e| !e.alive)
    })
    .await;
    // The other member joined either before the early leaver (it stays)
    // or after it, inheriting from a member that never handed anything
    // over: that join fails (gm's Lemma 2) and its node joins again.
    let settled = inner.current_now("q").version;
    wait_until("the other member at the settled view", || {
        let s = members[0].seen.lock().unwrap();
        s.removed || s.views.last().is_some_and(|&v| v >= settled)
    })
    .await;
    if members[0].seen.lock().unwrap().removed {
        members[0] = join(&nodes[1]).await;
        wait_until("the rejoined member in a view", || {
            !members[0].seen.lock().unwrap().views.is_empty()
        })
        .await;
    }
    broadcast_round(&mut members, &[0]).await;
    assert!(members[0].sent > 0, "the broadcasts were refused");
    wait_until("the remaining member's broadcasts confirmed", || {
        let s = members[0].seen.lock().unwrap();
        s.confirmed == members[0].sent
    })
    .await;
}

/// The driver's safety-net poll reads each ring's view as the node knows
/// it (`current_local`): on a quiet ring it asks the authority for nothing
/// fresh (with a Raft-backed authority, a fresh read is a round trip to the
/// leader, and a node with 1,000 rings polls 1,000 a second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_safety_net_poll_reads_views_locally() {
    use std::sync::atomic::Ordering::SeqCst;
    let net = Net::mem(10);
    // Never cut: only its read counts are used.
    let authority = Arc::new(Minority::default());
    let mut nodes = Vec::new();
    for i in 1..=2 {
        let detector =
            HeartbeatDetector::new(Duration::from_millis(20), Duration::from_millis(400));
        let name = format!("p{i}@gm");
        nodes.push(start_node_with(&net, &name, authority.clone(), Box::new(detector)).await);
    }
    let _members = join_all(&nodes).await;
    // Let the joins' own reads finish, then watch a quiet ring (polled
    // every 200 ms by default) for a second.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (fresh, local) = (
        authority.reads.load(SeqCst),
        authority.local_reads.load(SeqCst),
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let polled = authority.local_reads.load(SeqCst) - local;
    assert!(polled >= 4, "the poll read {polled} views in a second");
    assert_eq!(
        authority.reads.load(SeqCst),
        fresh,
        "fresh reads on a quiet ring"
    );
}

/// Three nodes with scripted detectors, j1's fed from the returned list,
/// introduced to each other.
async fn three_scripted(
    net: &Net,
    authority: &Arc<InMemoryAuthority>,
) -> (Vec<GmNode>, Arc<Mutex<Vec<NodeName>>>) {
    let suspect = Arc::new(Mutex::new(Vec::new()));
    let mut nodes = Vec::new();
    for i in 1..=3 {
        let detector = if i == 1 {
            Scripted(suspect.clone())
        } else {
            Scripted::default()
        };
        let name = format!("j{i}@gm");
        nodes.push(start_node_with(net, &name, authority.clone(), Box::new(detector)).await);
    }
    introduce(&nodes).await;
    (nodes, suspect)
}

/// Waits until every broadcast of `members[live]` is confirmed.
async fn wait_confirmed(members: &[Member], live: &[usize]) {
    wait_until("the broadcasts confirmed", || {
        live.iter()
            .all(|&i| members[i].seen.lock().unwrap().confirmed == members[i].sent)
    })
    .await;
}

/// A node that suspects a peer removes that peer's members from beside its
/// own, also one that joins later (from a node that does not suspect it):
/// a ring whose new member sits beside a member that cannot pass it the
/// traffic would stall until the two nodes hear each other again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_joins_beside_a_suspecting_node_is_removed() {
    let net = Net::mem(12);
    let authority = Arc::new(InMemoryAuthority::new());
    let (nodes, suspect) = three_scripted(&net, &authority).await;
    // Members on j1 and j3; then j1 loses j2 and suspects it while j2 has
    // no member (nothing to report then).
    let mut members = vec![join(&nodes[0]).await];
    wait_full_views(&members, 1).await;
    members.push(join(&nodes[2]).await);
    wait_full_views(&members, 2).await;
    net.mem.cut(nodes[0].node(), nodes[1].node());
    *suspect.lock().unwrap() = vec![nodes[1].node().clone()];
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        suspect.lock().unwrap().is_empty(),
        "the suspicion was polled"
    );
    // j2's new member joins (j2 suspects nobody), beside j1's.
    members.push(join(&nodes[1]).await);
    let j2 = members[2].handle.member();
    wait_until("j2's member removed", || {
        !authority.current_now("q").is_alive(j2)
    })
    .await;
    broadcast_round(&mut members, &[0, 1]).await;
    wait_confirmed(&members, &[0, 1]).await;
}

/// A node does not join a ring while a member of it lives on a node it
/// suspects (its member and that one would remove each other for as long
/// as the cut lasts); it joins once it hears from that node again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_joins_no_ring_beside_a_node_it_suspects() {
    let net = Net::mem(13);
    let authority = Arc::new(InMemoryAuthority::new());
    let (nodes, suspect) = three_scripted(&net, &authority).await;
    let mut members = join_in_turn(&nodes[1..]).await;
    net.mem.cut(nodes[0].node(), nodes[1].node());
    *suspect.lock().unwrap() = vec![nodes[1].node().clone()];
    tokio::time::sleep(Duration::from_millis(100)).await;
    members.push(join(&nodes[0]).await);
    let j1 = members[2].handle.member();
    // The ring of j2 and j3 goes on; j1's member waits outside it.
    broadcast_round(&mut members, &[0, 1]).await;
    wait_confirmed(&members, &[0, 1]).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        authority.current_now("q").entry(j1).is_none(),
        "joined beside a suspected node"
    );
    // Healed: j1 hears j2 again, joins, and the three carry on.
    net.mem.heal();
    wait_until("j1's member joined", || {
        authority.current_now("q").is_alive(j1)
    })
    .await;
    wait_full_views(&members, authority.current_now("q").version).await;
    broadcast_round(&mut members, &[0, 1, 2]).await;
    wait_confirmed(&members, &[0, 1, 2]).await;
}

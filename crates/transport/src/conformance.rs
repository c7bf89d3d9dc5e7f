//! The conformance suite: the same tests for every transport.
//!
//! A transport's test file implements [`Harness`] and invokes
//! [`conformance_tests!`](crate::conformance_tests), which expands to one
//! `#[tokio::test]` per property of the transport contract.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use warren_wire::{ClusterSecret, HandshakeError, NodeName};

use crate::{
    Connection, FrameReceiver, FrameSender, Listener, PeerAddr, Transport, TransportConfig,
    TransportError,
};

/// The longest any single step of the suite may take before it counts as a hang.
pub const STEP_LIMIT: Duration = Duration::from_secs(20);

/// Builds the transports and addresses a conformance test needs.
pub trait Harness: Send + Sync {
    /// A transport for a node with this configuration.
    fn transport(&self, config: TransportConfig) -> Arc<dyn Transport>;
    /// An address to listen on (the listener's `local_addr` is what dialers use).
    fn listen_addr(&self, node: &NodeName) -> PeerAddr;
    /// An address where nothing listens.
    fn dead_addr(&self) -> PeerAddr;
}

/// Runs the suite over one service's view of a [`Mux`](crate::mux::Mux) on
/// the harness `H`'s transport: each listener is a port of its own, each
/// dial selects the service.
pub struct Muxed<H>(pub H, pub crate::mux::Service);

impl<H> std::fmt::Debug for Muxed<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Muxed")
            .field(&self.1)
            .finish_non_exhaustive()
    }
}

impl<H: Harness> Harness for Muxed<H> {
    fn transport(&self, config: TransportConfig) -> Arc<dyn Transport> {
        let timeout = config.handshake_timeout;
        Arc::new(MuxedTransport {
            inner: self.0.transport(config),
            service: self.1,
            timeout,
        })
    }
    fn listen_addr(&self, node: &NodeName) -> PeerAddr {
        self.0.listen_addr(node)
    }
    fn dead_addr(&self) -> PeerAddr {
        self.0.dead_addr()
    }
}

/// A transport whose every listener is the view of `service` on a new port.
#[derive(Debug)]
struct MuxedTransport {
    inner: Arc<dyn Transport>,
    service: crate::mux::Service,
    timeout: Duration,
}

#[async_trait::async_trait]
impl Transport for MuxedTransport {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    async fn listen(&self, addr: &PeerAddr) -> Result<Box<dyn Listener>, TransportError> {
        let mux = crate::mux::Mux::listen(self.inner.as_ref(), addr, self.timeout).await?;
        mux.service(self.service, self.inner.clone())
            .listen(addr)
            .await
    }
    async fn connect(&self, addr: &PeerAddr) -> Result<Connection, TransportError> {
        crate::mux::dial(self.inner.as_ref(), addr, self.service, self.timeout).await
    }
}

/// A node's configuration for the suite: short timeouts and the given secret.
pub fn config(node: &str, secret: &str, max_frame_len: usize) -> TransportConfig {
    let mut c = TransportConfig::new(
        NodeName::new(node).expect("suite node names are valid"),
        ClusterSecret::new(secret),
    );
    c.max_frame_len = max_frame_len;
    c.connect_timeout = Duration::from_secs(3);
    c.handshake_timeout = Duration::from_secs(3);
    c
}

/// The cluster secret of the suite's nodes.
pub const SECRET: &str = "conformance-secret";
/// The maximum frame size the suite configures (1 MiB).
pub const MAX: usize = 1 << 20;

/// Awaits `fut`, panicking (naming `what`) if it takes longer than [`STEP_LIMIT`].
pub async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(STEP_LIMIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what} hung for more than {STEP_LIMIT:?}"),
    }
}

/// Dials `listener` with `dialer` until a connection is made at both ends,
/// within [`STEP_LIMIT`] (for listeners that refuse for a while, such as
/// one whose handshake slots are still being freed). Returns the dialer's end.
pub async fn connects_eventually(
    dialer: &dyn Transport,
    listener: &mut dyn Listener,
) -> Connection {
    let addr = listener.local_addr();
    within("a connection", async {
        loop {
            let (dialed, accepted) = tokio::join!(dialer.connect(&addr), async {
                tokio::time::timeout(Duration::from_secs(1), listener.accept()).await
            });
            if let (Ok(conn), Ok(Ok(_))) = (dialed, accepted) {
                return conn;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
}

async fn listen(h: &dyn Harness, node: &str, max: usize) -> Box<dyn Listener> {
    let cfg = config(node, SECRET, max);
    let addr = h.listen_addr(&cfg.node);
    within("listen", h.transport(cfg).listen(&addr))
        .await
        .expect("listen")
}

async fn dial(
    h: &dyn Harness,
    listener: &mut dyn Listener,
    client: TransportConfig,
) -> (Connection, Connection) {
    let client_t = h.transport(client);
    let addr = listener.local_addr();
    let (client, server) = within("connect and accept", async {
        tokio::join!(client_t.connect(&addr), listener.accept())
    })
    .await;
    (client.expect("connect"), server.expect("accept"))
}

fn numbered(i: u64, len: usize) -> Bytes {
    let mut v = i.to_be_bytes().to_vec();
    v.resize(len.max(8), (i % 251) as u8);
    Bytes::from(v)
}

fn len_of(i: u64) -> usize {
    8 + (i as usize * 37) % 300
}

async fn send_numbered(tx: &mut dyn FrameSender, n: u64) {
    for i in 0..n {
        tx.feed(numbered(i, len_of(i))).expect("feed");
        if i % 97 == 0 {
            tx.flush().await.expect("flush");
        }
    }
    tx.flush().await.expect("flush");
}

async fn recv_numbered(rx: &mut dyn FrameReceiver, n: u64) {
    let mut next = 0u64;
    let mut batch = Vec::new();
    while next < n {
        batch.clear();
        let got = rx.recv_batch(&mut batch, 1000).await.expect("recv");
        assert!(got > 0, "connection closed early at frame {next}");
        for f in &batch {
            assert_eq!(f.len(), len_of(next), "frame {next} has the wrong length");
            assert_eq!(
                u64::from_be_bytes(f[..8].try_into().expect("8 bytes")),
                next,
                "frames out of order"
            );
            next += 1;
        }
    }
}

/// Both ends learn each other's proven node name.
pub async fn peers_learn_names(h: &dyn Harness) {
    let mut l = listen(h, "server@suite", MAX).await;
    let (client, server) = dial(h, l.as_mut(), config("client@suite", SECRET, MAX)).await;
    assert_eq!(client.peer_node().as_str(), "server@suite");
    assert_eq!(server.peer_node().as_str(), "client@suite");
}

/// Many frames arrive whole and in order, both ways at once.
pub async fn in_order_both_ways(h: &dyn Harness) {
    let mut l = listen(h, "server@suite", MAX).await;
    let (client, server) = dial(h, l.as_mut(), config("client@suite", SECRET, MAX)).await;
    exchange_both_ways(client, server, 20_000).await;
}

/// Sends `n` numbered frames each way at once between `a` and `b` and
/// checks they arrive whole and in order.
async fn exchange_both_ways(a: Connection, b: Connection, n: u64) {
    let (mut a_tx, mut a_rx) = a.split();
    let (mut b_tx, mut b_rx) = b.split();
    within("exchange", async {
        tokio::join!(
            send_numbered(a_tx.as_mut(), n),
            recv_numbered(b_rx.as_mut(), n),
            send_numbered(b_tx.as_mut(), n),
            recv_numbered(a_rx.as_mut(), n),
        )
    })
    .await;
}

/// Frames of every size from 0 bytes to the maximum arrive intact.
pub async fn frames_from_empty_to_max(h: &dyn Harness) {
    let mut l = listen(h, "server@suite", MAX).await;
    let (mut client, mut server) = dial(h, l.as_mut(), config("client@suite", SECRET, MAX)).await;
    let sizes = [0usize, 1, 7, 1000, 64 * 1024, MAX - 1, MAX];
    for &size in &sizes {
        let frame: Bytes = (0..size)
            .map(|i| (i % 253) as u8)
            .collect::<Vec<u8>>()
            .into();
        within("send", client.send(frame.clone()))
            .await
            .expect("send");
        let got = within("recv", server.recv())
            .await
            .expect("recv")
            .expect("a frame");
        assert_eq!(got.len(), size);
        assert!(got == frame, "frame of {size} bytes corrupted");
        // And back again.
        within("echo", server.send(got)).await.expect("echo");
        let echoed = within("recv echo", client.recv())
            .await
            .expect("recv")
            .expect("a frame");
        assert!(echoed == frame, "echo of {size} bytes corrupted");
    }
}

/// `len` bytes that start with `tag` and differ along the frame (a lost,
/// repeated or misplaced piece shows).
fn patterned(tag: u64, len: usize) -> Bytes {
    let mut v = tag.to_be_bytes().to_vec();
    v.extend((8..len.max(8)).map(|i| (i % 251) as u8 ^ (i >> 16) as u8 ^ tag as u8));
    Bytes::from(v)
}

/// The next `n` frames on `rx`.
async fn recv_n(rx: &mut Connection, n: usize) -> Vec<Bytes> {
    let mut got = Vec::with_capacity(n);
    while got.len() < n {
        let f = within("recv", rx.recv())
            .await
            .expect("recv")
            .expect("a frame");
        got.push(f);
    }
    got
}

/// Checks that `got` are `want`'s frames, each lane's in order (a frame's
/// lane is its first byte).
fn check_lanes(got: &[Bytes], want: &[Bytes]) {
    assert_eq!(got.len(), want.len(), "frames lost or repeated");
    let lanes: std::collections::BTreeSet<u8> = want.iter().map(|f| f[0]).collect();
    for lane in lanes {
        let of_lane = |fs: &[Bytes]| -> Vec<Bytes> {
            fs.iter()
                .filter(|f| f.first() == Some(&lane))
                .cloned()
                .collect()
        };
        let (g, w) = (of_lane(got), of_lane(want));
        assert_eq!(g.len(), w.len(), "lane {lane}: frames lost or repeated");
        for (i, (g, w)) in g.iter().zip(&w).enumerate() {
            assert!(
                g == w,
                "lane {lane}: frame {i} of {} bytes corrupted or out of order",
                w.len()
            );
        }
    }
}

/// Frames over one chunk (16 MiB) up to the maximum (here two chunks and a
/// byte: three pieces) arrive whole, both ways, among whole frames fed
/// before and after them; a frame over the maximum is refused when fed.
pub async fn frames_over_one_chunk_arrive_whole(h: &dyn Harness) {
    let max = 2 * crate::MAX_CHUNK_LEN + 1;
    let mut l = listen(h, "server@suite", max).await;
    let (mut client, mut server) = dial(h, l.as_mut(), config("client@suite", SECRET, max)).await;
    let err = client
        .feed(Bytes::from(vec![0u8; max + 1]))
        .expect_err("over the maximum");
    assert!(matches!(err, TransportError::FrameTooLarge(_)), "{err:?}");
    let frames = [
        patterned(0, 100),
        patterned(1, crate::MAX_CHUNK_LEN + 1),
        patterned(2, 100),
        patterned(3, max),
        patterned(4, 8),
    ];
    for turn in 0..2 {
        let (from, to) = if turn == 0 {
            (&mut client, &mut server)
        } else {
            (&mut server, &mut client)
        };
        for f in &frames {
            from.feed(f.clone()).expect("feed");
        }
        let (got, sent) = tokio::join!(recv_n(to, frames.len()), within("flush", from.flush()));
        sent.expect("flush");
        check_lanes(&got, &frames);
    }
}

/// Frames of other lanes fed between the pieces of a long frame arrive
/// whole, each lane in order, and the long frame whole after them (here in
/// pieces of 4 KiB).
pub async fn lanes_interleave_with_a_long_frame(h: &dyn Harness) {
    let mut l = listen(h, "server@suite", MAX).await;
    let mut cfg = config("client@suite", SECRET, MAX);
    cfg.chunk_len = 4096;
    let (client, mut server) = dial(h, l.as_mut(), cfg).await;
    let (mut tx, _rx) = client.split();
    // Lane 1: a long frame, then a short one that must wait for it; lane 2:
    // short frames, one after each write of a piece.
    let mut want = vec![patterned(1 << 56, MAX), patterned(1 << 56 | 1, 10)];
    for f in &want {
        tx.feed_lane(1, f.clone()).expect("feed");
    }
    let sending = async {
        for i in 0..300u64 {
            let f = patterned(2 << 56 | i, len_of(i));
            tx.feed_lane(2, f.clone()).expect("feed");
            within("flush some", tx.flush_some()).await.expect("flush");
            want.push(f);
        }
        within("flush", tx.flush()).await.expect("flush");
        want
    };
    let (want, got) = tokio::join!(sending, recv_n(&mut server, 302));
    check_lanes(&got, &want);
}

/// Many peers send to one listener at once; each peer's frames stay in order.
pub async fn many_concurrent_senders(h: &dyn Harness) {
    let mut l = listen(h, "server@suite", MAX).await;
    const PEERS: usize = 8;
    const N: u64 = 2_000;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..PEERS {
        let (client, server) = dial(
            h,
            l.as_mut(),
            config(&format!("client{i}@suite"), SECRET, MAX),
        )
        .await;
        tasks.spawn(async move {
            let (mut c_tx, _c_rx) = client.split();
            let (_s_tx, mut s_rx) = server.split();
            tokio::join!(
                send_numbered(c_tx.as_mut(), N),
                recv_numbered(s_rx.as_mut(), N)
            );
        });
    }
    within("every peer's frames", async {
        while let Some(done) = tasks.join_next().await {
            done.expect("a peer's exchange");
        }
    })
    .await;
}

/// A peer that closes is seen as a clean end of stream after its last frame;
/// it can connect again and carry on.
pub async fn close_and_reconnect(h: &dyn Harness) {
    let mut l = listen(h, "server@suite", MAX).await;
    for round in 0..3u64 {
        let (mut client, mut server) =
            dial(h, l.as_mut(), config("client@suite", SECRET, MAX)).await;
        within("send", client.send(numbered(round, 64)))
            .await
            .expect("send");
        within("close", client.close()).await.expect("close");
        let got = within("recv", server.recv())
            .await
            .expect("recv")
            .expect("the last frame");
        assert_eq!(got, numbered(round, 64));
        let end = within("recv end", server.recv()).await;
        assert!(
            matches!(end, Ok(None) | Err(TransportError::ConnectionLost { .. })),
            "{end:?}"
        );
    }
}

/// Dialing an address where nothing listens fails with a clear error, in bounded time.
pub async fn connect_to_dead_address(h: &dyn Harness) {
    let t = h.transport(config("client@suite", SECRET, MAX));
    let addr = h.dead_addr();
    let err = within("connect to a dead address", t.connect(&addr))
        .await
        .expect_err("nothing listens there");
    assert!(
        matches!(
            err,
            TransportError::Connect { .. }
                | TransportError::ConnectTimeout { .. }
                | TransportError::HandshakeTimeout { .. }
        ),
        "unexpected error {err:?}"
    );
    assert!(
        err.to_string().contains(addr.as_str()),
        "error should name the address: {err}"
    );
}

/// A peer with another cluster secret is refused; the listener carries on.
pub async fn wrong_secret_refused(h: &dyn Harness) {
    let mut l = listen(h, "server@suite", MAX).await;
    let intruder = h.transport(config("intruder@suite", "not-the-secret", MAX));
    let addr = l.local_addr();
    let err = within("connect with a wrong secret", intruder.connect(&addr))
        .await
        .expect_err("a wrong secret is refused");
    match &err {
        TransportError::Handshake { source, .. } => assert!(
            matches!(
                source,
                HandshakeError::RefusedByPeer(_) | HandshakeError::WrongSecret { .. }
            ),
            "{source:?}"
        ),
        // A transport may cut the connection before the refusal arrives.
        TransportError::ConnectionLost { .. } => {}
        other => panic!("unexpected error {other:?}"),
    }
    // The listener still serves peers that know the secret.
    let (client, _server) = dial(h, l.as_mut(), config("client@suite", SECRET, MAX)).await;
    assert_eq!(client.peer_node().as_str(), "server@suite");
}

/// For transports with TLS: `intruder` (a transport whose certificate comes
/// from another CA, with the right cluster secret) is refused by TLS,
/// before the cluster handshake. Returns the intruder's error.
pub async fn intruder_refused_by_tls(h: &dyn Harness, intruder: &dyn Transport) -> TransportError {
    let l = listen(h, "server@suite", MAX).await;
    let err = within("an intruder's dial", intruder.connect(&l.local_addr()))
        .await
        .expect_err("a certificate from another CA is refused");
    assert!(
        matches!(
            err,
            TransportError::Tls(_) | TransportError::ConnectionLost { .. }
        ),
        "{err:?}"
    );
    err
}

/// A frame over the maximum is refused by its sender, and by a receiver
/// whose maximum is smaller than the sender's.
pub async fn oversized_frame_refused(h: &dyn Harness) {
    let small = 4096;
    let mut l = listen(h, "server@suite", small).await;
    let (mut client, _server) = dial(h, l.as_mut(), config("client@suite", SECRET, MAX)).await;
    // The sender refuses frames over its own maximum.
    let err = client
        .feed(Bytes::from(vec![0u8; MAX + 1]))
        .expect_err("over the sender's maximum");
    assert!(matches!(err, TransportError::FrameTooLarge(_)), "{err:?}");
    // The receiver refuses frames over its smaller maximum, whole or (in
    // pieces of 1 KiB, each under its maximum) split.
    for chunk_len in [MAX, 1024] {
        let mut cfg = config("client@suite", SECRET, MAX);
        cfg.chunk_len = chunk_len;
        let (mut client, mut server) = dial(h, l.as_mut(), cfg).await;
        within("send", client.send(Bytes::from(vec![1u8; small + 1])))
            .await
            .expect("the sender's maximum allows it");
        let err = within("recv", server.recv())
            .await
            .expect_err("over the receiver's maximum");
        assert!(matches!(err, TransportError::FrameTooLarge(_)), "{err:?}");
        assert!(err.to_string().contains("maximum frame size"), "{err}");
    }
}

/// Expands to one `#[tokio::test]` per conformance property for the harness `$h`.
#[macro_export]
macro_rules! conformance_tests {
    ($h:expr) => {
        $crate::conformance_tests!(@each $h;
            peers_learn_names,
            in_order_both_ways,
            frames_from_empty_to_max,
            many_concurrent_senders,
            close_and_reconnect,
            connect_to_dead_address,
            wrong_secret_refused,
            oversized_frame_refused,
            frames_over_one_chunk_arrive_whole,
            lanes_interleave_with_a_long_frame
        );
    };
    (@each $h:expr; $($name:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let harness = $h;
                $crate::conformance::$name(&harness).await;
            }
        )*
    };
}

// ------------------------------------------------------------------ the mux

/// How long the mux tests give a peer to name its service.
const SELECT_TIMEOUT: Duration = Duration::from_millis(300);

/// A node with a multiplexed peer port over the harness's transport.
struct MuxNode {
    transport: Arc<dyn Transport>,
    mux: crate::mux::Mux,
}

impl MuxNode {
    async fn start(h: &dyn Harness, node: &str) -> Self {
        let cfg = config(node, SECRET, MAX);
        let addr = h.listen_addr(&cfg.node);
        let transport = h.transport(cfg);
        let mux = within(
            "listen",
            crate::mux::Mux::listen(transport.as_ref(), &addr, SELECT_TIMEOUT),
        )
        .await
        .expect("listen");
        Self { transport, mux }
    }

    fn view(&self, service: crate::mux::Service) -> Arc<dyn Transport> {
        self.mux.service(service, self.transport.clone())
    }

    async fn listen(&self, service: crate::mux::Service) -> Box<dyn Listener> {
        within("listen", self.view(service).listen(&self.mux.local_addr()))
            .await
            .expect("a service listens at the port's address")
    }
}

/// Connections that name different services reach those services'
/// listeners, which all report the one port's address, and carry frames
/// both ways.
pub async fn mux_routes_each_service(h: &dyn Harness) {
    use crate::mux::Service;
    let server = MuxNode::start(h, "server@suite").await;
    let client = MuxNode::start(h, "client@suite").await;
    let services = [Service::Metadata, Service::Rings, Service::Links];
    let mut listeners = Vec::new();
    for s in services {
        let l = server.listen(s).await;
        assert_eq!(l.local_addr(), server.mux.local_addr());
        listeners.push(l);
    }
    let addr = server.mux.local_addr();
    // Dial in reverse order, each sending its service's name.
    for (i, s) in services.iter().enumerate().rev() {
        let mut conn = within("connect", client.view(*s).connect(&addr))
            .await
            .expect("connect");
        assert_eq!(conn.peer_node().as_str(), "server@suite");
        within("send", conn.send(Bytes::from(s.to_string())))
            .await
            .expect("send");
        let mut accepted = within("accept", listeners[i].accept())
            .await
            .expect("accept");
        assert_eq!(accepted.peer_node().as_str(), "client@suite");
        let got = within("recv", accepted.recv()).await.expect("recv");
        assert_eq!(got, Some(Bytes::from(s.to_string())), "{s}");
        within("reply", accepted.send(Bytes::from_static(b"back")))
            .await
            .expect("reply");
        let back = within("recv reply", conn.recv()).await.expect("recv");
        assert_eq!(back, Some(Bytes::from_static(b"back")));
    }
}

/// A peer that names an unknown service, or none, is dropped; a service
/// that does not listen refuses dials (until it listens); meanwhile the
/// port serves everyone else.
pub async fn mux_drops_strays(h: &dyn Harness) {
    use crate::mux::Service;
    let server = MuxNode::start(h, "server@suite").await;
    let client = MuxNode::start(h, "client@suite").await;
    let addr = server.mux.local_addr();
    let mut rings = server.listen(Service::Rings).await;
    // A silent peer, and one naming a service that does not exist.
    let mut silent = within("connect", client.transport.connect(&addr))
        .await
        .expect("the handshake itself succeeds");
    let mut unknown = within("connect", client.transport.connect(&addr))
        .await
        .expect("the handshake itself succeeds");
    within("send", unknown.send(Bytes::from_static(&[0x7f])))
        .await
        .expect("send");
    // Others are served while they wait.
    let _dialed = connects_eventually(client.view(Service::Rings).as_ref(), rings.as_mut()).await;
    for (what, conn) in [("unknown", &mut unknown), ("silent", &mut silent)] {
        let end = within("the stray's end", conn.recv()).await;
        assert!(
            matches!(end, Ok(None) | Err(_)),
            "a {what} peer was answered: {end:?}"
        );
    }
    // A service that does not listen refuses; once it listens it serves.
    let err = within("connect", client.view(Service::Links).connect(&addr))
        .await
        .expect_err("the links do not listen");
    assert!(err.to_string().contains("forwarding links"), "{err}");
    let mut links = server.listen(Service::Links).await;
    let _dialed = connects_eventually(client.view(Service::Links).as_ref(), links.as_mut()).await;
    // One listener per service; another address is not the port's.
    let err = within("listen", server.view(Service::Links).listen(&addr))
        .await
        .expect_err("the links listen already");
    assert!(matches!(err, TransportError::Listen { .. }), "{err:?}");
    drop(links);
    let _again = server.listen(Service::Links).await;
    let elsewhere = h.dead_addr();
    let err = within("listen", server.view(Service::Metadata).listen(&elsewhere))
        .await
        .expect_err("not the port's address");
    assert!(err.to_string().contains("peer address"), "{err}");
}

/// The port opened on another runtime (as a node opens it on Raft's) serves
/// a service whose tasks, and whose dialing transport, are this runtime's:
/// accepted and dialed connections carry frames both ways.
pub async fn mux_across_runtimes(h: &dyn Harness) {
    use crate::mux::{Mux, Service};
    let other = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a second runtime");
    let cfg = config("server@suite", SECRET, MAX);
    let addr = h.listen_addr(&cfg.node);
    let port_transport = h.transport(cfg.clone());
    let mux = within(
        "listen on the other runtime",
        other.spawn(
            async move { Mux::listen(port_transport.as_ref(), &addr, SELECT_TIMEOUT).await },
        ),
    )
    .await
    .expect("the listen task")
    .expect("listen");
    let rings = mux.service(Service::Rings, h.transport(cfg));
    let mut listener = within("listen", rings.listen(&mux.local_addr()))
        .await
        .expect("listen");
    let client = MuxNode::start(h, "client@suite").await;
    let mut client_listener = client.listen(Service::Rings).await;
    let (server_addr, client_addr) = (mux.local_addr(), client.mux.local_addr());
    let client_rings = client.view(Service::Rings);
    let (dialed, accepted) = within("connect and accept", async {
        tokio::join!(client_rings.connect(&server_addr), listener.accept())
    })
    .await;
    let (back_dialed, back_accepted) = within("connect back and accept", async {
        tokio::join!(rings.connect(&client_addr), client_listener.accept())
    })
    .await;
    exchange_both_ways(dialed.expect("connect"), accepted.expect("accept"), 2_000).await;
    exchange_both_ways(
        back_dialed.expect("connect back"),
        back_accepted.expect("accept back"),
        2_000,
    )
    .await;
    drop((listener, rings, mux));
    tokio::task::spawn_blocking(move || drop(other))
        .await
        .expect("dropping the other runtime");
}

/// Expands to one `#[tokio::test]` per test of the peer-port multiplexer
/// ([`crate::mux`]) over the harness `$h`.
#[macro_export]
macro_rules! mux_tests {
    ($h:expr) => {
        $crate::conformance_tests!(@each $h; mux_routes_each_service, mux_drops_strays, mux_across_runtimes);
    };
}

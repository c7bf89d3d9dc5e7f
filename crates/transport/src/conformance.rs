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
    let (mut c_tx, mut c_rx) = client.split();
    let (mut s_tx, mut s_rx) = server.split();
    const N: u64 = 20_000;
    within("exchange", async {
        tokio::join!(
            send_numbered(c_tx.as_mut(), N),
            recv_numbered(s_rx.as_mut(), N),
            send_numbered(s_tx.as_mut(), N),
            recv_numbered(c_rx.as_mut(), N),
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
    let (mut client, mut server) = dial(h, l.as_mut(), config("client@suite", SECRET, MAX)).await;
    // The sender refuses frames over its own maximum.
    let err = client
        .feed(Bytes::from(vec![0u8; MAX + 1]))
        .expect_err("over the sender's maximum");
    assert!(matches!(err, TransportError::FrameTooLarge(_)), "{err:?}");
    // The receiver refuses frames over its smaller maximum.
    within("send", client.send(Bytes::from(vec![1u8; small + 1])))
        .await
        .expect("the sender's maximum allows it");
    let err = within("recv", server.recv())
        .await
        .expect_err("over the receiver's maximum");
    assert!(matches!(err, TransportError::FrameTooLarge(_)), "{err:?}");
    assert!(err.to_string().contains("maximum frame size"), "{err}");
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
            oversized_frame_refused
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

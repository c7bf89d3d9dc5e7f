//! A QUIC listener's handshake slots: connections it is still
//! authenticating are bounded; one more is refused at once.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use quinn::crypto::rustls::QuicClientConfig;
use warren_tls::{CLUSTER_SERVER_NAME, ClusterCa};
use warren_transport::conformance::{config, connects_eventually, within};
use warren_transport::{PeerAddr, Transport};
use warren_transport_quic::{QuicOptions, QuicTransport};

static CA: LazyLock<ClusterCa> = LazyLock::new(|| ClusterCa::generate("pre-auth").expect("CA"));

fn transport(node: &str, handshake_slots: usize) -> QuicTransport {
    let mut cfg = config(node, "s", 1 << 20);
    // No handshake times out within the test: a refusal comes from the slots.
    cfg.handshake_timeout = Duration::from_secs(600);
    cfg.max_pending_handshakes = handshake_slots;
    let id = CA.issue(node).expect("node certificate");
    QuicTransport::new(cfg, &id, &QuicOptions::default()).expect("QUIC config")
}

/// A connection that finished the QUIC handshake but never opens its
/// stream (so never starts the cluster handshake) holds the only slot: a
/// member is refused until it leaves, then connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_handshake_slots_are_refused() {
    let mut l = transport("server@pre-auth", 1)
        .listen(&PeerAddr::new("127.0.0.1:0"))
        .await
        .expect("listen");
    let addr = l.local_addr();
    let target = addr.as_str().parse().expect("a socket address");

    let id = CA.issue("stalled@pre-auth").expect("certificate");
    let tls = id.client_config(&[b"warren-peer/1"]).expect("TLS config");
    let client = quinn::ClientConfig::new(Arc::new(
        QuicClientConfig::try_from(tls).expect("QUIC TLS config"),
    ));
    let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().expect("addr")).expect("endpoint");
    let stalled = within("the stalled connection", async {
        endpoint
            .connect_with(client, target, CLUSTER_SERVER_NAME)
            .expect("connect")
            .await
    })
    .await
    .expect("the QUIC handshake");

    let member = transport("member@pre-auth", 64);
    within("a refused dial", member.connect(&addr))
        .await
        .expect_err("every handshake slot is taken");

    stalled.close(0u32.into(), b"leaving");
    connects_eventually(&member, l.as_mut()).await;
}

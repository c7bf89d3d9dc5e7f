//! The transport conformance suite over TCP, plain and with mutual TLS (from
//! one shared CA, and from CAs each node derives from a shared seed).

use std::sync::{Arc, LazyLock};

use warren_tls::ClusterCa;
use warren_transport::conformance::{Harness, SECRET, config, intruder_refused_by_tls};
use warren_transport::{NodeName, PeerAddr, Transport, TransportConfig, TransportError};
use warren_transport_tcp::TcpTransport;

fn dead_tcp_addr() -> PeerAddr {
    // Bind then drop a listener: its port is free, so nothing answers there.
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    PeerAddr::from(l.local_addr().expect("addr"))
}

struct Plain;

impl Harness for Plain {
    fn transport(&self, config: TransportConfig) -> Arc<dyn Transport> {
        Arc::new(TcpTransport::new(config))
    }
    fn listen_addr(&self, _node: &NodeName) -> PeerAddr {
        PeerAddr::new("127.0.0.1:0")
    }
    fn dead_addr(&self) -> PeerAddr {
        dead_tcp_addr()
    }
}

static CA: LazyLock<ClusterCa> = LazyLock::new(|| ClusterCa::generate("conformance").expect("CA"));

/// Where a TLS node's certificate comes from.
#[derive(Clone, Copy)]
enum Tls {
    /// One CA that every node's certificate is issued from.
    Shared,
    /// Each node derives the CA from the same seed on its own, as nodes
    /// without a CA directory do from the cluster secret.
    Derived,
}

impl Harness for Tls {
    fn transport(&self, config: TransportConfig) -> Arc<dyn Transport> {
        let id = match self {
            Self::Shared => CA.issue(config.node.as_str()),
            Self::Derived => {
                ClusterCa::derive(&[42; 32]).and_then(|ca| ca.issue(config.node.as_str()))
            }
        };
        let id = id.expect("node certificate");
        Arc::new(TcpTransport::with_tls(config, &id).expect("TLS config"))
    }
    fn listen_addr(&self, _node: &NodeName) -> PeerAddr {
        PeerAddr::new("127.0.0.1:0")
    }
    fn dead_addr(&self) -> PeerAddr {
        dead_tcp_addr()
    }
}

/// A node whose certificate comes from `foreign` (not the harness's CA) is
/// refused by TLS, with an error that says what that means: the dialer
/// checks the listener's certificate first.
async fn foreign_certificate_refused(harness: Tls, foreign: ClusterCa) {
    let id = foreign.issue("intruder@suite").unwrap();
    let intruder = TcpTransport::with_tls(config("intruder@suite", SECRET, 1024), &id).unwrap();
    let err = intruder_refused_by_tls(&harness, &intruder).await;
    assert!(
        err.to_string().contains(
            "its certificate is not from this node's cluster CA: the two nodes have different \
             cluster secrets or CAs"
        ),
        "{err}"
    );
}

mod plain {
    use super::*;
    warren_transport::conformance_tests!(Plain);
}

mod tls {
    use super::*;
    warren_transport::conformance_tests!(Tls::Shared);

    #[tokio::test]
    async fn certificate_from_another_ca_refused() {
        foreign_certificate_refused(Tls::Shared, ClusterCa::generate("other").unwrap()).await;
    }
}

mod derived_tls {
    use super::*;
    warren_transport::conformance_tests!(Tls::Derived);

    #[tokio::test]
    async fn certificate_from_a_ca_derived_from_another_seed_refused() {
        foreign_certificate_refused(Tls::Derived, ClusterCa::derive(&[43; 32]).unwrap()).await;
    }
}

/// The suite and the multiplexer's tests over one service's view of a
/// multiplexed peer port.
mod muxed {
    use warren_transport::conformance::Muxed;
    use warren_transport::mux::Service;

    use super::*;

    mod plain {
        use super::*;
        warren_transport::conformance_tests!(Muxed(Plain, Service::Metadata));
        warren_transport::mux_tests!(Plain);
    }

    mod tls {
        use super::*;
        warren_transport::conformance_tests!(Muxed(Tls::Shared, Service::Rings));
        warren_transport::mux_tests!(Tls::Shared);
    }
}

/// Outgoing connections bind the configured source address (so firewall
/// rules between 127.0.0.x nodes see the node's own address).
#[tokio::test]
async fn dials_from_the_configured_address() {
    let raw = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = PeerAddr::from(raw.local_addr().unwrap());
    let mut cfg = config("client@suite", "s", 1024);
    cfg.bind_ip = Some("127.0.0.3".parse().unwrap());
    cfg.handshake_timeout = std::time::Duration::from_millis(200);
    let client = TcpTransport::new(cfg);
    let (dialed, accepted) = tokio::join!(client.connect(&addr), raw.accept());
    let (_stream, remote) = accepted.unwrap();
    assert_eq!(remote.ip().to_string(), "127.0.0.3");
    // The raw listener never answers the handshake, so the dial times out cleanly.
    assert!(
        matches!(dialed, Err(TransportError::HandshakeTimeout { .. })),
        "{dialed:?}"
    );
}

//! The transport conformance suite over TCP, plain and with mutual TLS.

use std::sync::{Arc, LazyLock};

use warren_tls::ClusterCa;
use warren_transport::conformance::Harness;
use warren_transport::{NodeName, PeerAddr, Transport, TransportConfig};
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

struct Tls;

impl Harness for Tls {
    fn transport(&self, config: TransportConfig) -> Arc<dyn Transport> {
        let id = CA.issue(config.node.as_str()).expect("node certificate");
        Arc::new(TcpTransport::with_tls(config, &id).expect("TLS config"))
    }
    fn listen_addr(&self, _node: &NodeName) -> PeerAddr {
        PeerAddr::new("127.0.0.1:0")
    }
    fn dead_addr(&self) -> PeerAddr {
        dead_tcp_addr()
    }
}

mod plain {
    use super::*;
    warren_transport::conformance_tests!(Plain);
}

mod tls {
    use super::*;
    warren_transport::conformance_tests!(Tls);

    /// A node whose certificate comes from another CA is refused by TLS.
    #[tokio::test]
    async fn certificate_from_another_ca_refused() {
        let cfg = warren_transport::conformance::config("server@suite", "s", 1024);
        let server = Tls.transport(cfg);
        let l = server.listen(&PeerAddr::new("127.0.0.1:0")).await.unwrap();
        let other_ca = ClusterCa::generate("other").unwrap();
        let cfg = warren_transport::conformance::config("intruder@suite", "s", 1024);
        let id = other_ca.issue("intruder@suite").unwrap();
        let intruder = TcpTransport::with_tls(cfg, &id).unwrap();
        let err = intruder.connect(&l.local_addr()).await.unwrap_err();
        assert!(
            matches!(
                err,
                warren_transport::TransportError::Tls(_)
                    | warren_transport::TransportError::ConnectionLost { .. }
            ),
            "{err:?}"
        );
    }
}

/// Outgoing connections bind the configured source address (so firewall
/// rules between 127.0.0.x nodes see the node's own address).
#[tokio::test]
async fn dials_from_the_configured_address() {
    let raw = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = PeerAddr::from(raw.local_addr().unwrap());
    let mut cfg = warren_transport::conformance::config("client@suite", "s", 1024);
    cfg.bind_ip = Some("127.0.0.3".parse().unwrap());
    cfg.handshake_timeout = std::time::Duration::from_millis(200);
    let client = TcpTransport::new(cfg);
    let (dialed, accepted) = tokio::join!(client.connect(&addr), raw.accept());
    let (_stream, remote) = accepted.unwrap();
    assert_eq!(remote.ip().to_string(), "127.0.0.3");
    // The raw listener never answers the handshake, so the dial times out cleanly.
    assert!(
        matches!(
            dialed,
            Err(warren_transport::TransportError::HandshakeTimeout { .. })
        ),
        "{dialed:?}"
    );
}
